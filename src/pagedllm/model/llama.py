"""LlamaForCausalLM: the Llama-family decoder (Llama, SmolLM, Mistral, Qwen2) over a
flat batch of tokens from many sequences, with no padding.

`forward(input_ids, positions, kv_caches, attn_metadata)` returns the final hidden
states; `compute_logits` projects only the rows that need logits. Q/K/V and gate/up
projections are fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import ReferenceAttention
from pagedllm.model.config import ModelConfig
from pagedllm.model.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]
AttentionFn = Callable[..., torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 whatever the model dtype, as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionFn, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_weight = _param(q_size + 2 * kv_size, cfg.hidden_size)
        self.qkv_bias = _param(q_size + 2 * kv_size) if cfg.attention_bias else None
        self.o_weight = _param(cfg.hidden_size, q_size)
        self.gate_up_weight = _param(2 * cfg.intermediate_size, cfg.hidden_size)
        self.down_weight = _param(cfg.hidden_size, cfg.intermediate_size)
        self.attention = attention
        self.rotary = rotary

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = hidden.shape[0]
        x = self.input_layernorm(hidden)
        q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        attn = self.attention(q, k, v, kv_cache[0], kv_cache[1], meta)
        hidden = hidden + F.linear(attn.reshape(t, -1), self.o_weight)
        x = self.post_attention_layernorm(hidden)
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, self.down_weight)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionFn | None = None) -> None:
        super().__init__()
        self.config = config
        if attention is None:
            attention = ReferenceAttention(
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
                scale=config.head_dim**-0.5,
            )
        self.rotary = RotaryEmbedding(config)
        self.embed_tokens = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, attention, self.rotary) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else _param(config.vocab_size, config.hidden_size)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, positions, kv_cache, attn_metadata)
        return self.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (fp32) of the given rows of final hidden states."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up."""

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weight {name!r} is missing from the checkpoint")
            return weights[name]

        with torch.no_grad():
            self.embed_tokens.copy_(take("model.embed_tokens.weight"))
            self.norm.weight.copy_(take("model.norm.weight"))
            if self.lm_head is not None:
                self.lm_head.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                a = p + "self_attn."
                layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(
                    take(p + "post_attention_layernorm.weight")
                )
                layer.qkv_weight.copy_(
                    torch.cat([take(f"{a}{n}_proj.weight") for n in "qkv"], dim=0)
                )
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(
                        torch.cat([take(f"{a}{n}_proj.bias") for n in "qkv"], dim=0)
                    )
                layer.o_weight.copy_(take(a + "o_proj.weight"))
                layer.gate_up_weight.copy_(
                    torch.cat(
                        [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0
                    )
                )
                layer.down_weight.copy_(take(p + "mlp.down_proj.weight"))
