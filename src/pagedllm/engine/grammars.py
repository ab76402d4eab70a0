"""Grammars: the engine's structured-output bookkeeping, one matcher per sequence.

It holds the grammar compiler (pagedllm/structured/grammar.py, built at the first request
that asks for structured output: xgrammar loads torch, which an engine over a fake runner
never needs, and the compiler starts its worker processes) and the matcher of every
sequence that follows a grammar, by sequence id.
A matcher advances with each token the engine accepts, so it survives preemption by
recompute (the accepted tokens stay) and is forked with a parallel sample. A token the
grammar rejects raises GrammarError: the engine fails that request alone.
A thinking model's grammar may wait for its reasoning to end (SamplingParams.think_tokens,
vLLM's rule): the sequence draws freely until its think-end token, and the grammar holds
the tokens after it. When the output may open with a think-start token instead of the
answer, its first token is the grammar's or that token.
Each step the matchers of the step's grammar rows write the tokens they allow into one
int32 bitmask (pagedllm/structured/bitmask.py), allocated at the first grammar row and
reused after: the runner gets that plain tensor, never a matcher.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.errors import GrammarError, InvalidParameterError
from pagedllm.sampling_params import StructuredOutputs, ThinkTokens

if TYPE_CHECKING:
    from pagedllm.core.sequence import Sequence
    from pagedllm.structured.bitmask import StepBitmask
    from pagedllm.structured.grammar import GrammarCompiler, GrammarState


@dataclass
class _Waiting:
    """A grammar that starts after the reasoning: `start` is the think-start token
    while the first token may still open reasoning, None once it is reasoning."""

    state: GrammarState
    end: int
    start: int | None


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
        self._waiting: dict[int, _Waiting] = {}  # ... before its reasoning has ended
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

    def add(self, seq_id: int, state: GrammarState, think: ThinkTokens | None = None) -> None:
        """The sequence follows `state`'s grammar: from its first token, or after its
        reasoning (`think`)."""
        if think is None:
            self._states[seq_id] = state
        else:
            self._waiting[seq_id] = _Waiting(state, think.end, think.start)

    def get(self, seq_id: int) -> GrammarState | None:
        """The matcher that masks the sequence's next token, if one does."""
        state = self._states.get(seq_id)
        if state is None and (waiting := self._waiting.get(seq_id)) and waiting.start is not None:
            return waiting.state
        return state

    def follows(self, seq_id: int) -> bool:
        """Whether the sequence has a grammar, started or waiting for its reasoning."""
        return seq_id in self._states or seq_id in self._waiting

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child sample follows the parent's grammar from the parent's place."""
        state = self._states.get(parent_id)
        if state is not None:
            self._states[child_id] = state.fork()
        waiting = self._waiting.get(parent_id)
        if waiting is not None:
            self._waiting[child_id] = _Waiting(waiting.state.fork(), waiting.end, waiting.start)

    def fill_bitmask(self, seq_id: int, row: int) -> None:
        """Row `row` of the step's bitmask gets the tokens the sequence's grammar allows
        next (and the think-start token, while the first token may open reasoning)."""
        state = self.get(seq_id)
        assert state is not None, "fill_bitmask of a sequence that get() gives no matcher"
        if self._bitmask is None:
            from pagedllm.structured.bitmask import StepBitmask

            self._bitmask = StepBitmask(self._vocab_size)
        try:
            self._bitmask.fill(row, state)
        except Exception as exc:
            raise GrammarError(f"the grammar's matcher failed: {exc}") from exc
        waiting = self._waiting.get(seq_id)
        if waiting is not None and waiting.start is not None:
            self._bitmask.allow(row, waiting.start)

    @property
    def bitmask(self) -> Any:
        """The step's bitmask (an int32 tensor, one row per grammar row that
        `fill_bitmask` wrote); None before the first grammar row."""
        return self._bitmask.tensor if self._bitmask is not None else None

    def accept(self, seq_id: int, token_id: int) -> None:
        """Advance the sequence's matcher (if it has one) by its new token; a grammar
        waiting for the reasoning starts after its end token, or at once when the first
        token does not open reasoning."""
        state = self._states.get(seq_id)
        if state is None:
            waiting = self._waiting.get(seq_id)
            if waiting is None:
                return
            if waiting.start is None:  # in the reasoning
                if token_id == waiting.end:
                    self._states[seq_id] = self._waiting.pop(seq_id).state
                return
            if token_id == waiting.start:  # the first token opens reasoning
                waiting.start = None
                return
            # the first token is the answer's: the grammar holds it
            state = self._states[seq_id] = self._waiting.pop(seq_id).state
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
            self._waiting.pop(seq.seq_id, None)

    def __len__(self) -> int:
        return len(self._states) + len(self._waiting)
