"""SamplingParams and BeamSearchParams: how one request's tokens are chosen.

Validated on creation: a bad value raises InvalidParameterError (a ValueError) that
carries the field's name and says its allowed range; the server returns it as HTTP 400.
`StructuredOutputs` asks for output that follows a grammar (vLLM's shape): a JSON
schema, any JSON object, a regex, one of a list of choices, or an EBNF grammar.
`RequestOutputKind` says what each of a request's outputs carries (vLLM's kinds). Plain
Python (no torch, no grammar library): the grammar is compiled by the engine
(pagedllm/structured/).
"""

from __future__ import annotations

import enum
import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

from pagedllm.bounded_json import JSONTooDeepError, check_depth, loads
from pagedllm.errors import InvalidParameterError
from pagedllm.validation import INT64_MAX, INT64_MIN, check_int, is_int, shown

MAX_LOGPROBS = 20
# A temperature below this is greedy: dividing logits by it overflows float32 (the
# vLLM rule).
GREEDY_TEMPERATURE = 1e-5


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        if _too_big(value):
            allowed += " (integers must fit in 64 bits)"
        raise InvalidParameterError(name, f"{name} must be {allowed}, got {shown(value)}")


def _too_big(value: object) -> bool:
    """An integer past int64, alone or inside lists and maps (their keys), at any depth."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            stack.extend(item)
        elif isinstance(item, int) and not INT64_MIN <= item <= INT64_MAX:
            return True
    return False


def _is_num(x: object) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an int past float's range
        return False


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries, as in vLLM."""

    CUMULATIVE = 0  # an output at every step, with everything generated so far
    DELTA = 1  # an output at every step, with only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request ends, with everything


def _check_output_kind(kind: object) -> None:
    names = ", ".join(f"RequestOutputKind.{k.name}" for k in RequestOutputKind)
    _check(isinstance(kind, RequestOutputKind), "output_kind", f"one of {names}", kind)


# The ways to ask for structured output, one per request (StructuredOutputs' fields).
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain the output to a grammar: set exactly one of the fields.

    `json`: a JSON schema (a dict, or its JSON text); `json_object`: any JSON object;
    `regex`: a regular expression the whole output matches; `choice`: one of these
    strings exactly; `grammar`: an EBNF grammar (GBNF / xgrammar syntax, rule `root`).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameterError(
                "structured_outputs",
                "structured_outputs must set exactly one of "
                + ", ".join(KINDS)
                + f", got {', '.join(given) or 'none'}",
            )
        if self.json is not None:
            schema = self.json
            try:
                if isinstance(schema, str):
                    schema = loads(schema)
                else:
                    check_depth(schema)
            except JSONTooDeepError as exc:
                raise InvalidParameterError(
                    "structured_outputs.json", f"structured_outputs.json {exc}"
                ) from None
            except ValueError as exc:
                raise InvalidParameterError(
                    "structured_outputs.json",
                    f"structured_outputs.json must be a JSON schema; its text is not JSON: {exc}",
                ) from None
            _check(
                isinstance(schema, dict),
                "structured_outputs.json",
                "a JSON schema (an object)",
                self.json,
            )
        _check(
            isinstance(self.json_object, bool),
            "structured_outputs.json_object",
            "true or false",
            self.json_object,
        )
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None:
                _check(
                    isinstance(v, str) and v != "",
                    f"structured_outputs.{name}",
                    "a non-empty string",
                    v,
                )
        if self.choice is not None:
            _check(
                isinstance(self.choice, (list, tuple))
                and len(self.choice) > 0
                and all(isinstance(c, str) and c for c in self.choice),
                "structured_outputs.choice",
                "a non-empty list of non-empty strings",
                self.choice,
            )
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """The field that is set: json, json_object, regex, choice or grammar."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, text): the same grammar gives the same key (the compile cache's). A
        schema's text is compact, without its annotations (a changed description is the
        same grammar), and keeps its order: the output follows the order of its
        properties."""
        kind = self.kind
        if kind == "json":
            schema = self.json if isinstance(self.json, dict) else _json.loads(str(self.json))
            return kind, _json.dumps(_without_annotations(schema), separators=(",", ":"))
        if kind == "choice":
            return kind, _json.dumps(list(self.choice or ()))
        if kind == "json_object":
            return kind, ""
        return kind, str(getattr(self, kind))


# JSON Schema's annotations (its meta-data vocabulary, and comments): they do not change
# which documents match, nor the grammar compiled from the schema.
_ANNOTATIONS = frozenset(
    {"title", "description", "examples", "default", "deprecated", "readOnly", "writeOnly"}
    | {"$comment"}
)
# Where a schema holds schemas: one, a list of them, or a map of names to them. Other
# values (`enum`, `const`, `required`, ...) are data and stay as they are.
_SUBSCHEMA = frozenset(
    {"additionalProperties", "not", "if", "then", "else", "contains", "propertyNames"}
    | {"additionalItems", "unevaluatedItems", "unevaluatedProperties", "items"}
)
_SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_SUBSCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def _without_annotations(schema: Any) -> Any:
    """`schema` without the annotations of any schema in it (depth checked already)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {name: _without_annotations(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            value = [_without_annotations(sub) for sub in value]
        elif key in _SUBSCHEMA:
            value = _without_annotations(value)
        out[key] = value
    return out


@dataclass(frozen=True)
class ThinkTokens:
    """The tokens a thinking model's reasoning block opens and ends with: a grammar
    (`structured_outputs`) holds only the answer after `end`. `start` None: the output
    opens in reasoning (the chat template opened the block); else the output reasons
    only if its first token is `start`, and is the answer at once otherwise."""

    end: int
    start: int | None = None

    def __post_init__(self) -> None:
        _check(is_int(self.end) and self.end >= 0, "think_tokens.end", "a token id >= 0", self.end)
        _check(
            self.start is None or (is_int(self.start) and self.start >= 0),
            "think_tokens.start",
            "a token id >= 0 or None",
            self.start,
        )


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # log-probabilities of the prompt's tokens (each with the `prompt_logprobs` most likely
    # tokens at its position): RequestOutput.prompt_logprobs. The prompt is then computed
    # whole, never taken from the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> value added to its logit before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    # output that follows a grammar (a JSON schema, a regex, ...); None: free text
    structured_outputs: StructuredOutputs | None = None
    # where a thinking model's reasoning ends: the grammar of structured_outputs starts
    # after it (None: the grammar holds the whole output)
    think_tokens: ThinkTokens | None = None
    # what each output carries: everything so far (the default), only what is new, or
    # nothing until the request ends (engine/output_processor.py says how each is built)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        check_int(self.n, "n", min=1)
        if self.best_of is not None:
            check_int(self.best_of, "best_of", min=self.n, allowed=f"an integer >= n ({self.n})")
        _check(
            _is_num(self.temperature) and self.temperature >= 0,
            "temperature",
            "in [0, inf)",
            self.temperature,
        )
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        # A top_k at or above the vocabulary keeps every token, as -1 does.
        check_int(
            self.top_k,
            "top_k",
            min=-1,
            allowed="-1 or 0 (disabled) or an integer >= 1 "
            "(at or above the vocabulary: every token)",
        )
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        if self.seed is not None:
            check_int(self.seed, "seed", allowed="an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_num(v) and -2 <= v <= 2, name, "in [-2, 2]", v)
        _check(
            _is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
            "repetition_penalty",
            "in (0, 10]",
            self.repetition_penalty,
        )
        if self.max_tokens is not None:
            check_int(self.max_tokens, "max_tokens", min=1)
        upper = self.max_tokens if self.max_tokens is not None else "inf"
        check_int(
            self.min_tokens,
            "min_tokens",
            min=0,
            max=self.max_tokens,
            allowed=f"an integer in [0, max_tokens={upper}]",
        )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, min=0, max=MAX_LOGPROBS)
        stop = self.stop
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        _check(
            all(isinstance(s, str) and s for s in stops),
            "stop",
            "a non-empty string or a list of them",
            self.stop,
        )
        object.__setattr__(self, "stop", stops)
        ids = tuple(self.stop_token_ids or ())
        _check(
            all(is_int(t) and t >= 0 for t in ids),
            "stop_token_ids",
            "a list of token ids >= 0",
            self.stop_token_ids,
        )
        object.__setattr__(self, "stop_token_ids", ids)
        if self.logit_bias is not None:
            bias = self.logit_bias
            _check(
                isinstance(bias, dict)
                and all(is_int(t) and t >= 0 for t in bias)
                and all(_is_num(v) and -100 <= v <= 100 for v in bias.values()),
                "logit_bias",
                "a map of token ids >= 0 to values in [-100, 100]",
                bias,
            )
            object.__setattr__(self, "logit_bias", dict(bias) or None)
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                so = StructuredOutputs(**so)
            except TypeError:
                raise InvalidParameterError(
                    "structured_outputs",
                    f"structured_outputs takes the fields {', '.join(KINDS)}, got {sorted(so)}",
                ) from None
            object.__setattr__(self, "structured_outputs", so)
        _check(
            so is None or isinstance(so, StructuredOutputs),
            "structured_outputs",
            "a StructuredOutputs (or a dict of its fields) or None",
            so,
        )
        _check(
            self.think_tokens is None or isinstance(self.think_tokens, ThinkTokens),
            "think_tokens",
            "a ThinkTokens or None",
            self.think_tokens,
        )
        _check_output_kind(self.output_kind)

    @property
    def num_seqs(self) -> int:
        """Sequences sampled for the request (best_of of them, n returned)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True)
class BeamSearchParams:
    """Deterministic beam search, scored as transformers does (see engine/beam_search.py)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    # The hypotheses are known only when the search ends: DELTA gives them then, as
    # FINAL_ONLY does; CUMULATIVE also gives an output with none at every step before.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        check_int(self.beam_width, "beam_width", min=1)
        check_int(self.max_tokens, "max_tokens", min=1)
        _check(
            _is_num(self.length_penalty), "length_penalty", "a finite number", self.length_penalty
        )
        _check_output_kind(self.output_kind)
