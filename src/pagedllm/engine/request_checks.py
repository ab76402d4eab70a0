"""RequestChecks: whether a request could ever run on this engine, decided before it queues.

Token ids within the vocabulary, stop ids and logit-bias keys too, a beam search the
vocabulary can feed, several sequences only where the KV reservation shares blocks, and a
prompt plus max_tokens that fit the context and the pool (Scheduler.check_fits). It reads
only what the engine's configuration fixes, so the server may call it from any thread.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from pagedllm.core.reservation import reserve_tokens
from pagedllm.engine.prompts import check_token_ids, encode_text
from pagedllm.engine.step_rows import beam_candidates
from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass(frozen=True)
class CheckedRequest:
    prompt_ids: list[int]
    num_seqs: int
    reserve_tokens: int  # KV tokens reserved up front (the paged reservation: none)


@dataclass(frozen=True)
class RequestChecks:
    tokenizer: Any
    vocab_size: int
    eos_token_ids: Collection[int]
    max_model_len: int
    kv_reservation: str
    # Scheduler.check_fits: (prompt tokens, max new tokens, sequences, reserved, param,
    # adapter pages)
    check_fits: Callable[[int, int, int, int, str, int], None]

    def check(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | BeamSearchParams,
        lora_pages: int = 0,
    ) -> CheckedRequest:
        """The request as it would run under an adapter of `lora_pages` pool pages (0: the
        base); InvalidParameterError naming the field otherwise."""
        is_beam = isinstance(params, BeamSearchParams)
        ids = encode_text(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        prompt_ids = check_token_ids(ids, self.vocab_size)
        vocab = self.vocab_size
        if isinstance(params, SamplingParams):
            if any(t >= vocab for t in params.stop_token_ids):
                raise InvalidParameterError(
                    "stop_token_ids", f"stop_token_ids must be in [0, {vocab - 1}]"
                )
            if any(t >= vocab for t in params.logit_bias or {}):
                raise InvalidParameterError(
                    "logit_bias", f"logit_bias keys must be token ids in [0, {vocab - 1}]"
                )
            think = params.think_tokens
            if think is not None and max(think.end, think.start or 0) >= vocab:
                raise InvalidParameterError(
                    "think_tokens", f"think_tokens must be token ids in [0, {vocab - 1}]"
                )
        elif beam_candidates(params, self.eos_token_ids) > vocab:
            raise InvalidParameterError(
                "beam_width", f"beam_width must be at most {vocab // 2} for this vocabulary"
            )
        num_seqs = params.beam_width if is_beam else params.num_seqs
        seqs_param = "beam_width" if is_beam else ("best_of" if params.best_of else "n")
        if num_seqs > 1 and self.kv_reservation != "paged":
            raise InvalidParameterError(
                seqs_param,
                f"kv_reservation={self.kv_reservation!r} is a one-sequence baseline: "
                "use n=1 (no best_of or beam search) or kv_reservation='paged'",
            )
        max_new = params.max_tokens or max(self.max_model_len - len(prompt_ids), 1)
        reserve = reserve_tokens(self.kv_reservation, len(prompt_ids), max_new, self.max_model_len)
        self.check_fits(len(prompt_ids), max_new, num_seqs, reserve, seqs_param, lora_pages)
        return CheckedRequest(prompt_ids, num_seqs, reserve)
