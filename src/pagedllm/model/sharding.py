"""Megatron-style sharding of a Llama-family checkpoint over N tensor-parallel ranks.

Rank r keeps whole heads: its slice of the q/k/v rows (query heads and KV heads alike)
and the matching columns of o_proj; a slice of the gate/up rows and the matching columns
of down_proj (an uneven split is fine: the partial sums still add up); a slice of the
vocabulary's rows of the embedding and of lm_head, padded so that every rank's logits
have the same width (what a gather needs). Norms are replicated. Since a rank holds its
KV heads' share of every KV block, block ids and block tables are the same on every rank.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedllm.errors import InvalidParameterError
from pagedllm.model.config import ModelConfig


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """InvalidParameterError naming `tensor_parallel_size` unless every rank gets whole
    query heads and whole KV heads."""
    for what, heads in (
        ("attention heads", config.num_attention_heads),
        ("KV heads", config.num_key_value_heads),
    ):
        if heads % size:
            raise InvalidParameterError(
                "tensor_parallel_size",
                f"tensor_parallel_size={size} must divide the model's {heads} {what}; "
                f"allowed: {', '.join(str(n) for n in range(1, heads + 1) if heads % n == 0)}",
            )


def vocab_share(vocab_size: int, size: int) -> int:
    """Rows of the vocabulary per rank, padded up."""
    return -(-vocab_size // size)


def _span(total: int, rank: int, size: int) -> slice:
    return slice(total * rank // size, total * (rank + 1) // size)


def shard_config(config: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The shape of rank `rank`'s share, as a model config of its own."""
    inner = _span(config.intermediate_size, rank, size)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=config.num_key_value_heads // size,
        intermediate_size=inner.stop - inner.start,
        vocab_size=vocab_share(config.vocab_size, size),
    )


def shard_weights(
    weights: dict[str, torch.Tensor], config: ModelConfig, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s share of Hugging Face-named weights, each tensor contiguous."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    # name suffix -> (dimension split, its full size); anything else is replicated
    splits = {
        "q_proj.weight": (0, q),
        "q_proj.bias": (0, q),
        "k_proj.weight": (0, kv),
        "k_proj.bias": (0, kv),
        "v_proj.weight": (0, kv),
        "v_proj.bias": (0, kv),
        "o_proj.weight": (1, q),
        "gate_proj.weight": (0, config.intermediate_size),
        "up_proj.weight": (0, config.intermediate_size),
        "down_proj.weight": (1, config.intermediate_size),
    }
    rows = vocab_share(config.vocab_size, size)
    out = {}
    for name, tensor in weights.items():
        suffix = ".".join(name.split(".")[-2:])
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            part = tensor.new_zeros(rows, tensor.shape[1])
            mine = tensor[rank * rows : (rank + 1) * rows]
            part[: mine.shape[0]] = mine
        elif suffix in splits:
            dim, total = splits[suffix]
            span = _span(total, rank, size)
            part = tensor.narrow(dim, span.start, span.stop - span.start)
        else:
            part = tensor
        out[name] = part.contiguous()
    return out
