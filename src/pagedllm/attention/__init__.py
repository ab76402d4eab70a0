"""Attention over a paged KV cache: the per-step metadata and the backends.

`reference.py` is the pure-torch oracle (and the CPU path); any faster backend must
match it.
"""

from pagedllm.attention.metadata import AttentionGroup, AttentionMetadata, build_attention_metadata
from pagedllm.attention.reference import ReferenceAttention

__all__ = ["AttentionGroup", "AttentionMetadata", "ReferenceAttention", "build_attention_metadata"]
