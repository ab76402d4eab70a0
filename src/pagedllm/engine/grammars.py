"""Grammars: the engine's structured-output bookkeeping, one matcher per sequence.

It holds the grammar compiler (pagedllm/structured/grammar.py, built at the first request
that asks for structured output: xgrammar loads torch, which an engine over a fake runner
never needs, and the compiler starts its worker processes) and the matcher of every
sequence that follows a grammar, by sequence id.
A matcher advances with each token the engine accepts, so it survives preemption by
recompute (the accepted tokens stay) and is forked with a parallel sample. A token the
grammar rejects raises GrammarError: the engine fails that request alone.
Each step the matchers of the step's grammar rows write the tokens they allow into one
int32 bitmask (pagedllm/structured/bitmask.py), allocated at the first grammar row and
reused after: the runner gets that plain tensor, never a matcher.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Set
from typing import TYPE_CHECKING, Any

from pagedllm.errors import GrammarError, InvalidParameterError
from pagedllm.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    from pagedllm.core.sequence import Sequence
    from pagedllm.structured.bitmask import StepBitmask
    from pagedllm.structured.grammar import GrammarCompiler, GrammarState


class Grammars:
    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Set[int], cache_bytes: int
    ) -> None:
        """`cache_bytes`: the most the compiled grammars kept for reuse may take."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._cache_bytes = cache_bytes
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # the compiler is built once, by whichever thread
        self._states: dict[int, GrammarState] = {}  # sequence id -> its matcher
        self._bitmask: StepBitmask | None = None  # built at the first grammar row

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise InvalidParameterError(
                        "structured_outputs",
                        "structured_outputs needs the model's tokenizer, and this engine has none",
                    )
                from pagedllm.structured.grammar import GrammarCompiler

                self._compiler = GrammarCompiler(
                    self._tokenizer,
                    self._vocab_size,
                    self._eos_token_ids,
                    cache_bytes=self._cache_bytes,
                )
            return self._compiler

    def compile(self, spec: StructuredOutputs, param: str | None = None) -> Any:
        """The compiled grammar (cached); InvalidParameterError naming `param` (default
        `structured_outputs.<kind>`)."""
        return self.compiler.compile(spec, param)

    def start(self, compiled: Any) -> GrammarState:
        """A matcher at the start of a grammar from `compile`."""
        return self.compiler.matcher(compiled)

    def close(self) -> None:
        """Stop the compiler's worker processes, if it was built."""
        with self._lock:
            if self._compiler is not None:
                self._compiler.close()

    def add(self, seq_id: int, state: GrammarState) -> None:
        self._states[seq_id] = state

    def get(self, seq_id: int) -> GrammarState | None:
        return self._states.get(seq_id)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child sample follows the parent's grammar from the parent's place."""
        state = self._states.get(parent_id)
        if state is not None:
            self._states[child_id] = state.fork()

    def fill_bitmask(self, seq_id: int, row: int) -> None:
        """Row `row` of the step's bitmask gets the tokens the sequence's grammar allows
        next."""
        state = self._states[seq_id]
        if self._bitmask is None:
            from pagedllm.structured.bitmask import StepBitmask

            self._bitmask = StepBitmask(self._vocab_size)
        try:
            self._bitmask.fill(row, state)
        except Exception as exc:
            raise GrammarError(f"the grammar's matcher failed: {exc}") from exc

    @property
    def bitmask(self) -> Any:
        """The step's bitmask (an int32 tensor, one row per grammar row that
        `fill_bitmask` wrote); None before the first grammar row."""
        return self._bitmask.tensor if self._bitmask is not None else None

    def accept(self, seq_id: int, token_id: int) -> None:
        """Advance the sequence's matcher (if it has one) by its new token."""
        state = self._states.get(seq_id)
        if state is None:
            return
        try:
            accepted = state.accept(token_id)
        except Exception as exc:
            raise GrammarError(f"the grammar's matcher failed: {exc}") from exc
        if not accepted:
            raise GrammarError(f"token {token_id} does not follow the request's grammar")

    def terminated(self, seq_id: int) -> bool:
        state = self._states.get(seq_id)
        return state is not None and state.terminated

    def forget(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self._states.pop(seq.seq_id, None)

    def __len__(self) -> int:
        return len(self._states)
