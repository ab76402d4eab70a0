"""Prompt-lookup (n-gram) proposer: guesses a sequence's next tokens by finding its last
n tokens earlier in the same sequence (prompt + output so far) and proposing the tokens
that followed them there. No model, no torch: plain Python over token ids.

The rule follows vLLM's NgramProposer: the longest n in [prompt_lookup_min,
prompt_lookup_max] whose suffix occurs earlier wins, and up to k tokens after that
occurrence are proposed (fewer when it lies near the end; none past max_model_len).
Where several occurrences share that longest n, vLLM takes the earliest; this module
takes the most recent by default (`prefer="latest"`) and vLLM's choice with
`prefer="earliest"`.

Cost: one reversed copy of the ids, then candidate positions found with `list.index`
(a C scan) on the last token, each checked over at most prompt_lookup_max tokens:
O(len * prompt_lookup_max) in the worst case, O(len) in practice. At 8,192 tokens with
prompt_lookup 1..5 and k 5, on a shared 2-core Zen 3 machine: ids drawn at random from a
49,152-token vocabulary (the scan finds almost no candidate) 0.17-0.27 ms per call; a
worst case where every other token equals the last one but no candidate extends past it
2.1-3.0 ms (either preference). So 64 sequences of 8k random ids cost ~15 ms of Python per
step; an index kept per sequence would make it O(1) per new token. Command: the n-gram
section of docs/speculative.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pagedllm.errors import InvalidParameterError
from pagedllm.validation import check_int

Preference = Literal["latest", "earliest"]


class NgramProposer:
    """Proposes up to `num_speculative_tokens` tokens for one sequence at a time."""

    def __init__(
        self,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        num_speculative_tokens: int,
        max_model_len: int | None = None,
        prefer: Preference = "latest",
    ) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise InvalidParameterError(
                "prompt_lookup_min",
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min} and {prompt_lookup_max}",
            )
        check_int(num_speculative_tokens, "num_speculative_tokens", min=1)
        if prefer not in ("latest", "earliest"):
            raise InvalidParameterError(
                "prefer", f"prefer must be 'latest' or 'earliest', got {prefer!r}"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.prefer = prefer

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """The tokens that followed the chosen earlier occurrence of the longest matching
        suffix of `token_ids`; [] when no suffix of at least prompt_lookup_min tokens
        occurs earlier."""
        n_tokens = len(token_ids)
        k = self.k
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - n_tokens)
        # An occurrence must end before the last token, so that something follows it.
        if k <= 0 or n_tokens <= self.min_n:
            return []
        # Reversed, the suffix is a prefix, and "an occurrence ending r tokens before the
        # end" is "a match of that prefix starting at r": candidates come from list.index.
        ids = list(token_ids)
        rev = ids[::-1]
        if self.prefer == "latest":
            best_len, best_r = self._latest(rev)
        else:
            best_len, best_r = self._earliest(ids, rev)
        if best_len < self.min_n:
            return []
        start = n_tokens - best_r  # first token after the occurrence
        return ids[start : start + k]

    def _match_length(self, rev: list[int], r: int) -> int:
        """How many leading tokens of `rev` (at most max_n) repeat at position r."""
        limit = min(self.max_n, len(rev) - r)
        n = 0
        while n < limit and rev[r + n] == rev[n]:
            n += 1
        return n

    def _latest(self, rev: list[int]) -> tuple[int, int]:
        best_len, best_r = 0, 0
        last = rev[0]
        r = 1
        while True:
            try:
                r = rev.index(last, r)
            except ValueError:
                return best_len, best_r
            n = self._match_length(rev, r)
            if n > best_len:  # strictly longer: a tie keeps the more recent one
                best_len, best_r = n, r
                if n == self.max_n:
                    return best_len, best_r
            r += 1

    def _earliest(self, ids: list[int], rev: list[int]) -> tuple[int, int]:
        """Scans from the sequence's start towards its end."""
        n_tokens = len(ids)
        last = rev[0]
        best_len, best_r = 0, 0
        e = 0  # end index, in the original order, of a candidate occurrence
        while True:
            try:
                e = ids.index(last, e, n_tokens - 1)
            except ValueError:
                return best_len, best_r
            r = n_tokens - 1 - e
            n = self._match_length(rev, r)
            if n > best_len:  # strictly longer: a tie keeps the earlier one
                best_len, best_r = n, r
                if n == self.max_n:
                    return best_len, best_r
            e += 1

    def propose_batch(self, sequences: Sequence[Sequence[int]]) -> list[list[int]]:
        """`propose` for each sequence, in order."""
        return [self.propose(ids) for ids in sequences]
