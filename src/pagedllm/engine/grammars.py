"""Grammars: the engine's structured-output bookkeeping, one matcher per sequence.

It holds the grammar compiler (pagedllm/structured/grammar.py, built at the first request
that asks for structured output: xgrammar loads torch, which an engine over a fake runner
never needs) and the matcher of every sequence that follows a grammar, by sequence id.
A matcher advances with each token the engine accepts, so it survives preemption by
recompute (the accepted tokens stay) and is forked with a parallel sample. A token the
grammar rejects raises GrammarError: the engine fails that request alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Set
from typing import TYPE_CHECKING, Any

from pagedllm.errors import GrammarError, InvalidParameterError
from pagedllm.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    from pagedllm.core.sequence import Sequence
    from pagedllm.structured.grammar import GrammarCompiler, GrammarState


class Grammars:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Set[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # the compiler is built once, by whichever thread
        self._states: dict[int, GrammarState] = {}  # sequence id -> its matcher

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
                    self._tokenizer, self._vocab_size, self._eos_token_ids
                )
            return self._compiler

    def compile(self, spec: StructuredOutputs, param: str | None = None) -> Any:
        """The compiled grammar (cached); InvalidParameterError naming `param` (default
        `structured_outputs.<kind>`)."""
        return self.compiler.compile(spec, param)

    def start(self, spec: StructuredOutputs) -> GrammarState:
        """A matcher at the start of `spec`'s grammar (compiled now unless cached)."""
        compiler = self.compiler
        return compiler.matcher(compiler.compile(spec))

    def add(self, seq_id: int, state: GrammarState) -> None:
        self._states[seq_id] = state

    def get(self, seq_id: int) -> GrammarState | None:
        return self._states.get(seq_id)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child sample follows the parent's grammar from the parent's place."""
        state = self._states.get(parent_id)
        if state is not None:
            self._states[child_id] = state.fork()

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
