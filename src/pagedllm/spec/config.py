"""SpeculativeConfig: how a sequence's next tokens are guessed before the target model
checks them, as one frozen, validated dataclass.

`method` "ngram" guesses by prompt lookup (spec/ngram.py); "draft" asks a smaller model
(`speculative_model`, its linear layers computing as `speculative_quantization` says, whose
values worker/options.py checks; worker/draft_model.py). A bad value raises
InvalidParameterError naming the engine option the user set (`speculative_method`,
`num_speculative_tokens`, ...), so that the CLI and the server report the flag as it was
given. `speculative_config_from` builds it from the
engine's options, None when speculation is off. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagedllm.errors import InvalidParameterError
from pagedllm.validation import check_int

SpeculativeMethod = Literal["ngram", "draft"]
METHODS: tuple[str, ...] = ("ngram", "draft")
# vLLM's rejection sampler takes at most this many proposed tokens per sequence.
MAX_SPECULATIVE_TOKENS = 128
# vLLM's prompt-lookup defaults, when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
# Speculate only while fewer sequences than this run, unless the engine's options say
# otherwise: measured with `pagedllm bench spec-streams --sweep` (docs/benchmarks.md) on
# 2-core CPUs, on the default model's GGUF blocks (the default path), n-gram speculation
# on chat (low acceptance) gave 0.98x the throughput at 4 running sequences and 0.90x at
# 8 (medians of three sweeps), and less above; at 1 and 2 sequences it pays or breaks even
# (one stream: 1.46x the tokens/s).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod
    num_speculative_tokens: int  # k: tokens proposed per sequence and step
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP  # ngram: shortest suffix matched
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP  # ngram: longest suffix matched
    speculative_model: str | None = None  # draft: the proposing model's path
    # draft: how the draft's linear layers compute (auto: as the model's quantization
    # auto decides, for the draft's own file)
    speculative_quantization: str = "auto"
    # Speculate only while fewer sequences than this are running (large batches are
    # compute-bound: checking guesses then costs more than it saves); None: always.
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidParameterError(
                "speculative_method",
                f"speculative_method must be one of {', '.join(METHODS)}, got {self.method!r}",
            )
        check_int(
            self.num_speculative_tokens, "num_speculative_tokens", min=1, max=MAX_SPECULATIVE_TOKENS
        )
        check_int(self.prompt_lookup_min, "prompt_lookup_min", min=1)
        check_int(self.prompt_lookup_max, "prompt_lookup_max", min=1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidParameterError(
                "prompt_lookup_min",
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})",
            )
        model = self.speculative_model
        if self.method == "draft" and (not isinstance(model, str) or not model.strip()):
            raise InvalidParameterError(
                "speculative_model",
                f"speculative_method 'draft' needs speculative_model (a model path), got {model!r}",
            )
        if self.method == "ngram" and model is not None:
            raise InvalidParameterError(
                "speculative_model",
                "speculative_model is only read with speculative_method 'draft'; "
                f"'ngram' proposes without a model, got {model!r}",
            )
        quantization = self.speculative_quantization
        if quantization != "auto" and self.method != "draft":
            raise InvalidParameterError(
                "speculative_quantization",
                "speculative_quantization is only read with speculative_method 'draft' (it "
                f"quantizes the draft model), got method {self.method!r}",
            )
        if self.disable_by_batch_size is not None:
            # 1 would never speculate: a running batch always has a sequence.
            check_int(self.disable_by_batch_size, "speculative_disable_by_batch_size", min=2)

    def speculates_at(self, num_running: int) -> bool:
        """Whether a step with `num_running` running sequences proposes tokens."""
        limit = self.disable_by_batch_size
        return limit is None or num_running < limit


def speculative_config_from(
    speculative_method: str | None = None,
    num_speculative_tokens: int | None = None,
    speculative_model: str | None = None,
    prompt_lookup_min: int | None = None,
    prompt_lookup_max: int | None = None,
    speculative_disable_by_batch_size: int | None = None,
    speculative_quantization: str = "auto",
) -> SpeculativeConfig | None:
    """The SpeculativeConfig the engine's options describe, None when they ask for no
    speculation. Unset, speculative_disable_by_batch_size is DEFAULT_DISABLE_BY_BATCH_SIZE
    (a value above any batch the engine runs speculates at every size). As in vLLM: a
    speculative_model alone means method "draft"; with one
    prompt-lookup bound given the other takes its value, with neither both are 5."""
    method = speculative_method
    if method is None and speculative_model is not None:
        method = "draft"
    if method is None:
        for option, is_set in (
            ("num_speculative_tokens", num_speculative_tokens is not None),
            ("prompt_lookup_min", prompt_lookup_min is not None),
            ("prompt_lookup_max", prompt_lookup_max is not None),
            ("speculative_disable_by_batch_size", speculative_disable_by_batch_size is not None),
            ("speculative_quantization", speculative_quantization != "auto"),
        ):
            if is_set:
                raise InvalidParameterError(
                    option, f"{option} is set but speculative_method is not (ngram or draft)"
                )
        return None
    if num_speculative_tokens is None:
        raise InvalidParameterError(
            "num_speculative_tokens",
            f"speculative_method {method!r} needs num_speculative_tokens (tokens proposed "
            "per step, e.g. 4)",
        )
    low = prompt_lookup_min if prompt_lookup_min is not None else prompt_lookup_max
    high = prompt_lookup_max if prompt_lookup_max is not None else prompt_lookup_min
    return SpeculativeConfig(
        method=method,  # type: ignore[arg-type] - checked in __post_init__
        num_speculative_tokens=num_speculative_tokens,
        prompt_lookup_min=DEFAULT_PROMPT_LOOKUP if low is None else low,
        prompt_lookup_max=DEFAULT_PROMPT_LOOKUP if high is None else high,
        speculative_model=speculative_model,
        disable_by_batch_size=(
            DEFAULT_DISABLE_BY_BATCH_SIZE
            if speculative_disable_by_batch_size is None
            else speculative_disable_by_batch_size
        ),
        speculative_quantization=speculative_quantization,
    )
