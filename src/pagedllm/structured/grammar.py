"""Grammars for structured output, compiled with xgrammar, and each sequence's place in one.

`GrammarCompiler` turns a request's StructuredOutputs into a compiled grammar for the
model's tokenizer. A grammar is compiled first in a worker process killed at `timeout_s`
(compile_pool.py), so one that would take minutes is refused in seconds and frees its
place; one that compiled in time is compiled again here. Compiled grammars are kept in a
cache bounded in bytes (grammar_cache.py) and refused ones are remembered, both by the
grammar itself (a schema without its annotations): repeating a refused grammar, or
changing only its description, never starts another compile. A grammar the library
cannot compile (a bad schema, regex or EBNF, a feature it lacks, no finite sentence), or
not within the bound, raises InvalidParameterError naming the field: the request is
refused before anything reaches a kernel. `GrammarState` is one sequence's matcher:
bookkeeping that advances with each accepted token, can be forked (n > 1) and can take
tokens back (rollback).

Imported only when a request asks for structured output: xgrammar loads torch.
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

import xgrammar as xgr

from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import StructuredOutputs
from pagedllm.structured.compile_pool import CompilePool, CompileRefusedError
from pagedllm.structured.compile_worker import compile_grammar
from pagedllm.structured.grammar_cache import GrammarCache

# A pathological grammar (a schema whose automaton explodes) must be a 400, never a stall:
# compile times on SmolLM2's 49k vocabulary are in docs/benchmarks.md (`pagedllm bench
# structured`).
COMPILE_TIMEOUT_S = 10.0
# Compiles running at once, each in its own worker process: a flood of distinct slow
# grammars holds at most this many workers, each for at most the bound, and the engine
# keeps the rest of the machine.
MAX_CONCURRENT_COMPILES = 2
REFUSED_ENTRIES = 1024  # refused grammars remembered (a digest and a line each)


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; thread-safe (server and engine)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        cache_bytes: int,
        timeout_s: float = COMPILE_TIMEOUT_S,
        max_concurrent: int = MAX_CONCURRENT_COMPILES,
    ) -> None:
        """`cache_bytes`: the most the kept compiled grammars may take."""
        self.stop_token_ids = sorted(stop_token_ids)
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        # The library's own cache is off: ours is bounded in bytes and remembers refusals.
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False
        )
        self.pool = CompilePool(info.serialize_json(), max_concurrent, timeout_s)
        weakref.finalize(self, self.pool.close)
        self._cache = GrammarCache(cache_bytes)
        self._refused: OrderedDict[bytes, str] = OrderedDict()  # grammar's digest -> why
        self._lock = threading.Lock()
        # compiles run (cache misses), by the name of the thread that asked: the server's
        # grammar threads, never the engine's (for tests and figures)
        self.compiles_by_thread: Counter[str] = Counter()

    def compile(self, spec: StructuredOutputs, param: str | None = None) -> Any:
        """The compiled grammar of `spec` (cached); InvalidParameterError naming `param`
        (default `structured_outputs.<kind>`) if it cannot be compiled within the bound;
        EngineOverloadedError if no compile worker came free within it."""
        kind, text = spec.key()
        key = hashlib.sha256(f"{kind}\0{text}".encode("utf-8", "surrogatepass")).digest()
        param = param or f"structured_outputs.{kind}"
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                return compiled
            reason = self._refused.get(key)
        if reason is None:
            try:
                compiled = self.pool.compile(
                    kind, text, lambda: compile_grammar(self._compiler, kind, text)
                )
            except CompileRefusedError as exc:
                reason = str(exc)
            with self._lock:
                self.compiles_by_thread[threading.current_thread().name] += 1
                if reason is None:
                    self._cache.put(key, compiled, compiled.memory_size_bytes)
                    return compiled
                self._refused[key] = reason
                while len(self._refused) > REFUSED_ENTRIES:
                    self._refused.popitem(last=False)
        raise InvalidParameterError(param, f"{param} {reason}")

    def matcher(self, compiled: Any) -> GrammarState:
        """A fresh matcher at the start of `compiled`; it ends at the model's EOS."""
        return GrammarState(
            xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids or None)
        )

    def close(self) -> None:
        """Stop the compile workers."""
        self.pool.close()


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
