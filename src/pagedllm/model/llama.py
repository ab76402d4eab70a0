"""LlamaForCausalLM: the common decoder of every supported family (Llama, SmolLM,
Mistral, Qwen2, Qwen3, Phi-3, Gemma 3) over a flat batch of tokens from many sequences,
with no padding.

The families are the same layer with a few switches read from ModelConfig: q/k norm
before rope, norms after attention and MLP too ("sandwich"), the MLP's activation, an
embedding scale, the attention scale, a per-layer attention window and rope base, and
a final logit soft cap. Gemma's (1 + w) norms are folded into the weights at load.
`forward(input_ids, positions, kv_caches, attn_metadata)` returns the final hidden
states; `compute_logits` projects only the rows that need logits. The attention backend
plans the step once (`prepare`) and every layer reads that plan, with its own window.
Q/K/V and gate/up projections are fused into one matmul each. Under tensor parallelism
the model is built from one rank's share (model/sharding.py) and a ParallelContext sums
the shares. The kind of linear layer is an option: "dense" (float weights) or "gguf" (a
GGUF file's blocks as stored, model/gguf_linear.py; the embedding table too, its rows
dequantized as they are looked up).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backends import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata, GroupedAttentionMetadata
from pagedllm.attention.reference import ReferenceAttention
from pagedllm.model.config import ModelConfig
from pagedllm.model.fused_layer import FusedGGUFLayers, FusedInt8Layer
from pagedllm.model.gguf_linear import GGUFLinear, GGUFWeight, embed_rows
from pagedllm.model.layer_ops import TorchLayerOps
from pagedllm.model.linear import DenseLinear, quantize_linears
from pagedllm.model.linear_deltas import LinearDeltas
from pagedllm.model.parallel import ParallelContext
from pagedllm.model.rotary import RotaryEmbedding
from pagedllm.model.weights import load_decoder_weights

KVCache = tuple[torch.Tensor, torch.Tensor]
LINEAR_KINDS = ("dense", "gguf")


def make_linear(
    kind: str, in_features: int, out_features: int, bias: bool, ops: Any, kernels: Any
) -> DenseLinear | GGUFLinear:
    """An empty linear layer of `kind`, filled by load_weights. `kernels`: the compiled
    kernels' namespace GGUF layers call (None: pure torch)."""
    if kind == "gguf":
        return GGUFLinear(in_features, out_features, bias, kernels)
    return DenseLinear(in_features, out_features, bias, ops)


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
        index: int,
        attention: AttentionBackend,
        rotary: RotaryEmbedding,
        ops: TorchLayerOps,
        parallel: ParallelContext | None = None,
        linear: str = "dense",
        kernels: Any = None,
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        eps, hidden, inter = cfg.rms_norm_eps, cfg.hidden_size, cfg.intermediate_size
        self.input_layernorm = RMSNorm(hidden, eps)  # before attention
        self.post_attention_layernorm = RMSNorm(hidden, eps)  # before the MLP
        # Optional parts of the families: None where the family has none.
        self.q_norm = RMSNorm(self.head_dim, eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if cfg.qk_norm else None
        self.attn_out_norm = RMSNorm(hidden, eps) if cfg.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(hidden, eps) if cfg.sandwich_norms else None
        self.qkv = make_linear(
            linear, hidden, q_size + 2 * kv_size, cfg.attention_bias, ops, kernels
        )
        self.o_proj = make_linear(linear, q_size, hidden, False, ops, kernels)
        self.gate_up = make_linear(linear, hidden, 2 * inter, False, ops, kernels)
        self.down = make_linear(linear, inter, hidden, False, ops, kernels)
        self.gelu = cfg.mlp_activation == "gelu_tanh"
        self.window = cfg.layer_window(index)  # tokens, or None: full attention
        self.index = index
        self.attention = attention
        self.rotary = rotary
        self.ops = ops
        self.parallel = parallel
        self.fused: FusedInt8Layer | None = None  # set by quantize_int8 where it applies

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: KVCache,
        plan: Any,
        deltas: LinearDeltas | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and the residual stream (updated in place): the next layer
        (or the final norm) adds the one to the other, fused with its norm. `plan`: the
        attention backend's plan of this step; `deltas`: what LoRA adapters add to the
        linear layers' outputs (the compiled layer has no place for them)."""
        if self.fused is not None and deltas is None:
            return self.fused(hidden, residual, positions, kv_cache, plan)
        t, ops, norm = hidden.shape[0], self.ops, self.input_layernorm
        if residual is None:  # the first layer: the embeddings are the residual stream
            residual, x = hidden, ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            x = ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        qkv = self.qkv(x)
        if deltas is not None:
            deltas.add(self.index, "qkv", x, qkv)
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads(qkv, self.q_norm, 0, self.num_heads)
            self._norm_heads(qkv, self.k_norm, self.num_heads, self.num_kv_heads)
        rope = self.rotary
        ops.rotary(positions, qkv, rope.cos, rope.sin, *self.split_heads)
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        attn = self.attention(q, k, v, kv_cache[0], kv_cache[1], plan, self.window)
        attn = attn.reshape(t, -1)
        out = self._sum(self.o_proj(attn))
        if deltas is not None:
            deltas.add(self.index, "o_proj", attn, out)
        if self.attn_out_norm is not None:
            out = ops.rms_norm(out, self.attn_out_norm.weight, self.attn_out_norm.eps)
        norm = self.post_attention_layernorm
        x = ops.add_rms_norm(out, residual, norm.weight, norm.eps)
        gate_up = self.gate_up(x)
        if deltas is not None:
            deltas.add(self.index, "gate_up", x, gate_up)
        act = ops.gelu_tanh_and_mul(gate_up) if self.gelu else ops.silu_and_mul(gate_up)
        out = self._sum(self.down(act))
        if deltas is not None:
            deltas.add(self.index, "down", act, out)
        if self.mlp_out_norm is not None:
            out = ops.rms_norm(out, self.mlp_out_norm.weight, self.mlp_out_norm.eps)
        return out, residual

    def _norm_heads(self, qkv: torch.Tensor, norm: RMSNorm, first: int, heads: int) -> None:
        """RMS-normalise heads [first, first + heads) of the fused projection in place,
        each head's vector on its own (Qwen3's and Gemma 3's q/k norm)."""
        d = self.head_dim
        part = qkv[:, first * d : (first + heads) * d]
        normed = self.ops.rms_norm(part.reshape(-1, d), norm.weight, norm.eps)
        part.copy_(normed.view(part.shape))

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
        linear: str = "dense",
        kernels: Any = None,
    ) -> None:
        """`attention` defaults to the reference backend, `ops` (the element-wise work)
        to pure torch; `parallel`, when given, is this rank's group (`config` its share).
        `linear`: the kind of linear layer (LINEAR_KINDS); `kernels`: the compiled kernels'
        namespace the "gguf" layers call (None: pure torch)."""
        super().__init__()
        if config.num_hidden_layers < 1:
            raise ValueError(f"a model needs at least one layer, got {config.num_hidden_layers}")
        if linear not in LINEAR_KINDS:
            raise ValueError(f"linear must be one of {LINEAR_KINDS}, got {linear!r}")
        if linear == "gguf" and parallel is not None:
            raise ValueError("GGUF linear layers run on one device, not tensor parallel")
        self.config = config
        ops = ops or TorchLayerOps()
        if attention is None:
            attention = ReferenceAttention(scale=config.attention_scale)
        self.attention = attention
        self.rotary = RotaryEmbedding(config)
        # Gemma 3's windowed layers: their own rope base, unscaled.
        self.local_rotary = None
        if any(config.uses_local_rope(i) for i in range(config.num_hidden_layers)):
            local = dataclasses.replace(
                config, rope_theta=config.local_rope_theta, rope_scaling=None
            )
            self.local_rotary = RotaryEmbedding(local)
        self.embed_tokens: nn.Parameter | GGUFWeight | None = (
            _param(config.vocab_size, config.hidden_size) if linear == "dense" else None
        )  # GGUF: the file's table, set at load
        # A float32 scalar, cast to the model's dtype with the model (as transformers does).
        scale = torch.tensor(config.embedding_scale or 1.0, dtype=torch.float32)
        self.register_buffer("embed_scale", scale, persistent=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, attention, self._rotary_of(i), ops, parallel, linear, kernels)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ops = ops
        self.parallel = parallel
        self.lm_head = make_linear(
            linear, config.hidden_size, config.vocab_size, False, ops, kernels
        )
        self.gguf_kernels = kernels if linear == "gguf" else None  # also for the lookup
        # All layers on GGUF blocks in one compiled call (fused_layer.py), set at load.
        self.fused_gguf: FusedGGUFLayers | None = None
        if config.tie_word_embeddings and isinstance(self.lm_head, DenseLinear):
            self.lm_head.weight = self.embed_tokens  # one tensor, two uses (GGUF: at load)

    def _rotary_of(self, layer: int) -> RotaryEmbedding:
        if self.config.uses_local_rope(layer) and self.local_rotary is not None:
            return self.local_rotary
        return self.rotary

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata | GroupedAttentionMetadata,
        deltas: LinearDeltas | None = None,
    ) -> torch.Tensor:
        """`attn_metadata`: one for every layer, or one per KV layer group (each layer
        reads its group's block tables). `deltas`: what the rows' LoRA adapters add to the
        linear layers' outputs (None: the base model for every row); it skips the
        compiled all-layers call, which has no place for them."""
        table = self.embed_tokens
        if isinstance(table, GGUFWeight):
            hidden = embed_rows(input_ids, table, self.gguf_kernels)
        else:
            embed = F.embedding if self.parallel is None else self.parallel.embed
            hidden = embed(input_ids, table)
        residual = None
        if self.config.embedding_scale is not None:
            hidden = hidden * self.embed_scale.to(hidden.dtype)
        grouped = GroupedAttentionMetadata.of(attn_metadata, len(self.layers))
        plans = [self.attention.prepare(m) for m in grouped.groups]  # once for its layers
        if self.fused_gguf is not None and len(plans) == 1 and deltas is None:
            hidden, residual = self.fused_gguf(hidden, positions, kv_caches, plans[0])
        else:
            layers = zip(self.layers, kv_caches, grouped.layer_group, strict=True)
            for layer, kv_cache, g in layers:
                hidden, residual = layer(hidden, residual, positions, kv_cache, plans[g], deltas)
        if residual is None:  # no layer ran: __init__ refuses such a model
            raise RuntimeError("the model ran no decoder layer")
        return self.ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (fp32) of the given rows of final hidden states."""
        logits = self.lm_head(hidden).float()
        if self.parallel is not None:
            logits = self.parallel.gather_logits(logits)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def quantize_int8(
        self, input_amax: dict[str, torch.Tensor] | None = None, ops: Any = None
    ) -> None:
        """Int8 weights and per-token int8 activations in every linear layer, the output
        projection included (smoothed with `input_amax`, from `observe_inputs` over this
        model); a tied embedding stays float, for its lookup. With the compiled kernels
        (`ops`), each plain Llama layer then runs as one compiled call (fused_layer.py)."""
        quantize_linears(self, input_amax, ops)
        if ops is None:
            return
        for layer in self.layers:
            layer.fused = FusedInt8Layer(layer, ops) if FusedInt8Layer.applies(layer) else None

    @property
    def fused_layers(self) -> int:
        """How many layers run in compiled calls (one a layer, or all in one)."""
        if self.fused_gguf is not None:
            return len(self.layers)
        return sum(layer.fused is not None for layer in self.layers)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up. Plain layers on
        GGUF blocks with the compiled kernels then run in one compiled call (fused_layer.py)."""
        load_decoder_weights(self, weights)
        if FusedGGUFLayers.applies(self.layers):
            self.fused_gguf = FusedGGUFLayers(self.layers, self.layers[0].qkv.kernels)
