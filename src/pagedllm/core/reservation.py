"""KV reservation policies: how many tokens' blocks a request reserves at admission.

`paged` reserves nothing ahead (a block when the last one fills). The others model the
systems PagedAttention replaced, which reserved one contiguous region per request up
front: `reserve-max` the whole `max_model_len` (FasterTransformer, Orca-Max),
`reserve-pow2` the final length rounded up to a power of two (Orca-Pow2), and
`reserve-oracle` exactly prompt + output (Orca-Oracle; the output length it knows is
`max_tokens`, exact when the workload ignores EOS).
"""

from __future__ import annotations

from pagedllm.errors import InvalidParameterError

RESERVATION_POLICIES = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")


def check_policy(policy: str) -> None:
    if policy not in RESERVATION_POLICIES:
        raise InvalidParameterError(
            "kv_reservation",
            f"kv_reservation must be one of {', '.join(RESERVATION_POLICIES)}; got {policy!r}",
        )


def reserve_tokens(policy: str, prompt_len: int, max_new_tokens: int, max_model_len: int) -> int:
    final = prompt_len + max_new_tokens
    if policy == "paged":
        return 0
    if policy == "reserve-max":
        return max_model_len
    if policy == "reserve-pow2":
        return min(1 << (final - 1).bit_length(), max_model_len)
    check_policy(policy)
    return min(final, max_model_len)  # reserve-oracle
