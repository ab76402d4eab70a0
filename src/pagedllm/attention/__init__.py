"""Attention over a paged KV cache: the per-step metadata and the backends.

`reference.py` is the pure-torch oracle (and the CPU path); any faster backend must
match it. Each backend builds its own per-step plan from the common metadata
(`backend.prepare(meta)`), which every layer's call reads.
"""

from pagedllm.attention.metadata import AttentionMetadata, build_attention_metadata
from pagedllm.attention.reference import ReferenceAttention

__all__ = ["AttentionMetadata", "ReferenceAttention", "build_attention_metadata"]
