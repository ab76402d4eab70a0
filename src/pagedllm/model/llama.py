"""LlamaForCausalLM: the Llama-family decoder (Llama, SmolLM, Mistral, Qwen2) over a
flat batch of tokens from many sequences, with no padding.

`forward(input_ids, positions, kv_caches, attn_metadata)` returns the final hidden
states; `compute_logits` projects only the rows that need logits. The attention backend
plans the step once (`prepare`) and every layer reads that plan. Q/K/V and gate/up
projections are fused into one matmul each. Under tensor parallelism the model is built
from one rank's share (model/sharding.py) and a ParallelContext sums the shares.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backends import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import ReferenceAttention
from pagedllm.model.config import ModelConfig
from pagedllm.model.layer_ops import TorchLayerOps
from pagedllm.model.linear import DenseLinear, quantize_linears
from pagedllm.model.parallel import ParallelContext
from pagedllm.model.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    """The weight and epsilon of an RMS norm; the layer ops compute it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        attention: AttentionBackend,
        rotary: RotaryEmbedding,
        ops: TorchLayerOps,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.qkv = DenseLinear(hidden, q_size + 2 * kv_size, cfg.attention_bias, ops)
        self.o_proj = DenseLinear(q_size, hidden, ops=ops)
        self.gate_up = DenseLinear(hidden, 2 * inter, ops=ops)
        self.down = DenseLinear(inter, hidden, ops=ops)
        self.attention = attention
        self.rotary = rotary
        self.ops = ops
        self.parallel = parallel

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: KVCache,
        plan: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and the residual stream (updated in place): the next layer
        (or the final norm) adds the one to the other, fused with its norm. `plan`: the
        attention backend's plan of this step."""
        t, ops, norm = hidden.shape[0], self.ops, self.input_layernorm
        if residual is None:  # the first layer: the embeddings are the residual stream
            residual, x = hidden, ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            x = ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        qkv = self.qkv(x)
        rope = self.rotary
        ops.rotary(positions, qkv, rope.cos, rope.sin, *self.split_heads)
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        attn = self.attention(q, k, v, kv_cache[0], kv_cache[1], plan)
        norm = self.post_attention_layernorm
        out = self._sum(self.o_proj(attn.reshape(t, -1)))
        x = ops.add_rms_norm(out, residual, norm.weight, norm.eps)
        return self._sum(self.down(ops.silu_and_mul(self.gate_up(x)))), residual

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        """A row-split projection's output: a partial sum on each rank, added up."""
        return x if self.parallel is None else self.parallel.all_reduce(x)

    @property
    def split_heads(self) -> tuple[int, int, int]:
        return self.num_heads, self.num_kv_heads, self.head_dim


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend | None = None,
        ops: TorchLayerOps | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        """`attention` defaults to the reference backend, `ops` (the element-wise work)
        to pure torch; `parallel`, when given, is this rank's group (`config` its share)."""
        super().__init__()
        if config.num_hidden_layers < 1:
            raise ValueError(f"a model needs at least one layer, got {config.num_hidden_layers}")
        self.config = config
        ops = ops or TorchLayerOps()
        if attention is None:
            attention = ReferenceAttention(scale=config.head_dim**-0.5)
        self.attention = attention
        self.rotary = RotaryEmbedding(config)
        self.embed_tokens = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, attention, self.rotary, ops, parallel)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ops = ops
        self.parallel = parallel
        self.lm_head = DenseLinear(config.hidden_size, config.vocab_size, ops=ops)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens  # one tensor, two uses

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        embed = F.embedding if self.parallel is None else self.parallel.embed
        hidden, residual = embed(input_ids, self.embed_tokens), None
        plan = self.attention.prepare(attn_metadata)  # once for every layer
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, kv_cache, plan)
        if residual is None:  # no layer ran: __init__ refuses such a model
            raise RuntimeError("the model ran no decoder layer")
        return self.ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (fp32) of the given rows of final hidden states."""
        logits = self.lm_head(hidden).float()
        return logits if self.parallel is None else self.parallel.gather_logits(logits)

    def quantize_int8(
        self, input_amax: dict[str, torch.Tensor] | None = None, ops: Any = None
    ) -> None:
        """Int8 weights and per-token int8 activations in every linear layer, the output
        projection included (smoothed with `input_amax`, from `observe_inputs` over this
        model); a tied embedding stays float, for its lookup."""
        quantize_linears(self, input_amax, ops)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up."""

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weight {name!r} is missing from the checkpoint")
            return weights[name]

        with torch.no_grad():
            self.embed_tokens.copy_(take("model.embed_tokens.weight"))
            self.norm.weight.copy_(take("model.norm.weight"))
            if not self.config.tie_word_embeddings:
                self.lm_head.weight.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                a = p + "self_attn."
                layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(
                    take(p + "post_attention_layernorm.weight")
                )
                layer.qkv.weight.copy_(
                    torch.cat([take(f"{a}{n}_proj.weight") for n in "qkv"], dim=0)
                )
                if layer.qkv.bias is not None:
                    layer.qkv.bias.copy_(
                        torch.cat([take(f"{a}{n}_proj.bias") for n in "qkv"], dim=0)
                    )
                layer.o_proj.weight.copy_(take(a + "o_proj.weight"))
                layer.gate_up.weight.copy_(
                    torch.cat(
                        [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0
                    )
                )
                layer.down.weight.copy_(take(p + "mlp.down_proj.weight"))
