"""Grammars for structured output, compiled with xgrammar, and each sequence's place in one.

`GrammarCompiler` turns a request's StructuredOutputs into a compiled grammar for the
model's tokenizer (built once per engine) and keeps the latest ones in a small LRU keyed
by the grammar's text, so that the server can compile off the engine thread and the
engine then finds the grammar cached. A grammar the library cannot compile (a bad schema,
regex or EBNF, or a feature it lacks), or whose compile runs past `timeout_s`, raises
InvalidParameterError naming the field: the request is refused before anything reaches a
kernel. `GrammarState` is one sequence's matcher: bookkeeping that advances with each
accepted token, can be forked (n > 1) and can take tokens back (rollback).

Imported only when a request asks for structured output: xgrammar loads torch.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

import xgrammar as xgr

from pagedllm.errors import EngineOverloadedError, InvalidParameterError
from pagedllm.sampling_params import StructuredOutputs

# A pathological grammar (a schema whose automaton explodes) must be a 400, never a stall:
# compile times on SmolLM2's 49k vocabulary are in docs/benchmarks.md (`pagedllm bench
# structured`).
COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 64
# Compiles running at once, a compile past the bound included (it cannot be interrupted
# and runs on until it ends): a flood of distinct slow schemas holds at most this many
# cores, and the engine keeps the rest. A request that finds every slot taken for
# `timeout_s` is told to retry (EngineOverloadedError), and its grammar is not refused.
MAX_CONCURRENT_COMPILES = 2
# The library's messages open with "[time] /path/file.cc:line: ": the client needs the rest.
_LOCATION = re.compile(r"^\s*\[[0-9:.]+\]\s*\S+:\d+:\s*")


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; thread-safe (server and engine)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        timeout_s: float = COMPILE_TIMEOUT_S,
        cache_size: int = CACHE_SIZE,
        max_concurrent: int = MAX_CONCURRENT_COMPILES,
    ) -> None:
        self.stop_token_ids = sorted(stop_token_ids)
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        # The library's own cache is off: ours is bounded in entries and remembers refusals.
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False
        )
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        # grammars refused (invalid, or too slow to compile): refused again at once, so
        # that repeating a pathological grammar never starts another compile
        self._refused: OrderedDict[tuple[str, str], str] = OrderedDict()  # -> why
        self._lock = threading.Lock()
        self._cache_size = cache_size
        self._slots = threading.BoundedSemaphore(max_concurrent)
        # compiles started (cache misses), by the name of the thread that asked: the
        # server's tokenizer thread, never the engine's (for tests and figures)
        self.compiles_by_thread: Counter[str] = Counter()

    @property
    def num_compiles(self) -> int:
        return sum(self.compiles_by_thread.values())

    def compile(self, spec: StructuredOutputs, param: str | None = None) -> Any:
        """The compiled grammar of `spec` (cached); InvalidParameterError naming `param`
        (default `structured_outputs.<kind>`) if it cannot be compiled within
        `timeout_s`; EngineOverloadedError if no compile slot came free within
        `timeout_s`."""
        key = spec.key()
        param = param or f"structured_outputs.{spec.kind}"
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            reason = self._refused.get(key)
        if reason is None:
            compiled, reason = self._compile_bounded(key)
            with self._lock:
                if reason is None:
                    _remember(self._cache, key, compiled, self._cache_size)
                    return compiled
                _remember(self._refused, key, reason, self._cache_size)
        raise InvalidParameterError(param, f"{param} {reason}")

    def matcher(self, compiled: Any) -> GrammarState:
        """A fresh matcher at the start of `compiled`; it ends at the model's EOS."""
        return GrammarState(
            xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids or None)
        )

    def _compile_bounded(self, key: tuple[str, str]) -> tuple[Any, str | None]:
        """(the compiled grammar, None), or (None, why it cannot be used). Compiled on a
        daemon thread holding one of the compile slots, waited for at most `timeout_s`:
        the library cannot be interrupted, so a compile past the bound runs on in the
        background, unwaited, keeping its slot until it ends (and its grammar is
        remembered as refused)."""
        kind, text = key
        if not self._slots.acquire(timeout=self.timeout_s):
            raise EngineOverloadedError(
                "every grammar compile slot has been busy for "
                f"{self.timeout_s:g} s (other requests' grammars): retry later"
            )
        with self._lock:
            self.compiles_by_thread[threading.current_thread().name] += 1
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["grammar"] = self._compile(kind, text)
            except Exception as exc:  # the library raises RuntimeError, and others
                box["error"] = exc
            finally:
                self._slots.release()
                done.set()

        threading.Thread(target=run, name="pagedllm-grammar", daemon=True).start()
        if not done.wait(self.timeout_s):
            return None, (
                f"did not compile within {self.timeout_s:g} s; simplify it (fewer "
                "alternatives, bounded repetition)"
            )
        if "error" in box:
            return None, f"cannot be used: {_clean(box['error'])}"
        return box["grammar"], None

    def _compile(self, kind: str, text: str) -> Any:
        c = self._compiler
        if kind == "json":
            # Compact JSON (no free whitespace): a weak model cannot pad the output with
            # spaces until max_tokens, and the output is as short as the schema allows.
            return c.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            rule = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
            return c.compile_grammar(f"root ::= {rule}")
        return c.compile_grammar(text)


class GrammarState:
    """One sequence's place in its grammar: advanced by each accepted token."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False (and no change) if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted tokens (speculation, lookahead)."""
        self._matcher.rollback(num_tokens)

    def fork(self) -> GrammarState:
        """An independent copy at the same place (a parallel sample's)."""
        return GrammarState(self._matcher.fork())

    @property
    def terminated(self) -> bool:
        """The grammar accepted its end (the EOS token): the output is complete."""
        return bool(self._matcher.is_terminated())

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (int32, one bit per
        token, from `allocate_bitmask`)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


def _remember(
    cache: OrderedDict[tuple[str, str], Any], key: tuple[str, str], value: Any, size: int
) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)


def _clean(exc: BaseException) -> str:
    """The library's message without its source location, on one line."""
    lines = [_LOCATION.sub("", line).strip() for line in str(exc).splitlines()]
    text = " ".join(line for line in lines if line)
    return text[:300] or type(exc).__name__
