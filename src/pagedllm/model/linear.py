"""The model's linear layers: dense, and int8 (W8A8) for CPUs.

`DenseLinear` holds float weights; the layer ops multiply. `Int8Linear` computes the same
product in int8: weights with one scale per output channel, and activations quantized at
every call with one scale per token (dynamic quantization); int8 x int8 products
accumulate in int32 and are rescaled to fp32. Per-token scales alone cost a small model
too much (SmolLM2-135M's perplexity rises about 4%): a few input channels carry outliers.
So each layer first moves part of its inputs' range into its weights (SmoothQuant: input
channel j is divided by s_j and the weights' column j multiplied by it, s_j =
max|x_j|^0.5 / max|W_j|^0.5, with max|x_j| observed on a short calibration text). The
compiled kernel (kernels/csrc/int8_linear.cpp) does a layer in one call, with the GEMM
chosen for this machine for many rows (kernels/int8_choice.py; its weights prepacked
once); the pure-torch path below computes the same numbers where it cannot run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedllm.kernels.cpu import cache_dir
from pagedllm.kernels.int8_choice import AVX2_GEMMS, CACHE_FILE, Int8Choice, choose_gemm, report
from pagedllm.kernels.policy import GEMV_MAX_ROWS, PANEL_GEMV_MAX_ROWS
from pagedllm.model.layer_ops import TorchLayerOps

SMOOTHING_ALPHA = 0.5


class DenseLinear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, ops: Any = None
    ) -> None:
        """`ops` (layer_ops.py) computes the product; None: the torch reference."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.ops = ops if ops is not None else TorchLayerOps()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        input_amax: torch.Tensor | None = None,
        ops: Any = None,
        gemm: str = "auto",
    ) -> None:
        """Quantize `weight` [out, in]; `input_amax` [in] (the largest |input| seen per
        channel) turns on smoothing; `ops` is the compiled kernels' namespace, if any;
        `gemm` the kernels' GEMM for many rows (see `use_gemm`)."""
        super().__init__()
        weight = weight.detach().float().cpu()
        smooth = torch.ones(weight.shape[1])
        if input_amax is not None:
            w_amax = weight.abs().amax(dim=0).clamp(min=1e-5)
            a = SMOOTHING_ALPHA
            smooth = (input_amax.float().clamp(min=1e-5) ** a / w_amax ** (1 - a)).clamp(min=1e-5)
        weight = weight * smooth[None, :]
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.weight_q = (weight / scale[:, None]).round().to(torch.int8)  # [out, in]
        self.weight_t = self.weight_q.t()  # the view the kernels take, made once
        self.weight_sums = self.weight_q.sum(dim=1, dtype=torch.int32)  # for the VNNI kernel
        self.weight_scale = scale.contiguous()
        self.inv_smooth = (1.0 / smooth).contiguous()
        self.bias = None if bias is None else bias.detach().float().cpu().contiguous()
        self.ops = ops
        self.gemm = "auto"
        self.panels: torch.Tensor | None = None
        if ops is not None:
            self.use_gemm(gemm)

    def use_gemm(self, gemm: str) -> None:
        """Compute more than GEMV_MAX_ROWS rows with the compiled GEMM `gemm` (a name of
        kernels/int8_choice.py, or "auto": the kernels' default, which packs its weights at
        every call), packing the weights once for it."""
        panel = AVX2_GEMMS.get(gemm)
        self.panels = None if panel is None else self.ops.int8_pack_panels(self.weight_q, panel)
        self.gemm = gemm

    @property
    def kernels(self) -> str:
        """The kernels this layer runs, by row count (what the benches print)."""
        if self.ops is None:
            return "pure torch (_int_mm)"
        _, vnni = self.ops.int8_has_vnni()
        gemm = self.gemm
        if gemm == "auto":  # what the compiled op's "auto" takes
            gemm = "_int_mm" if vnni else "gemm avx2"
        gemv = "gemv vnni" if vnni else "gemv avx2"
        if not vnni and self.gemm == "gemm avx2":  # its panels also take the fewest rows
            return (
                f"gemm avx2 panels up to {PANEL_GEMV_MAX_ROWS} rows, {gemv} up to "
                f"{GEMV_MAX_ROWS}, {gemm} above"
            )
        return f"{gemv} up to {GEMV_MAX_ROWS} rows, {gemm} above"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        if self.ops is not None:
            return self.ops.int8_linear(
                x,
                self.inv_smooth,
                self.weight_t,
                self.weight_scale,
                self.weight_sums,
                self.bias,
                self.panels,
                self.gemm,
            )
        xs = x * self.inv_smooth
        amax = xs.abs().amax(dim=-1, keepdim=True)
        row_scale = torch.where(amax > 0, amax / 127.0, 1.0)
        xq = torch.round(xs * (1.0 / row_scale)).to(torch.int8)
        out = torch._int_mm(xq, self.weight_q.t()).float() * row_scale * self.weight_scale
        return out if self.bias is None else out + self.bias


def observe_inputs(model: nn.Module, run: Callable[[], Any]) -> dict[str, torch.Tensor]:
    """The largest |input| per channel of each DenseLinear under `model` while `run()`
    runs the model (on calibration text), by module name."""
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, DenseLinear):

            def hook(_: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                seen = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0).float()
                amax[name] = torch.maximum(amax[name], seen) if name in amax else seen

            hooks.append(module.register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for handle in hooks:
            handle.remove()
    return amax


def quantize_linears(
    model: nn.Module,
    input_amax: dict[str, torch.Tensor] | None = None,
    ops: Any = None,
    gemm: str = "auto",
) -> int:
    """Replace every DenseLinear under `model` by an Int8Linear (smoothed where
    `input_amax`, from `observe_inputs`, has the layer; computed with `gemm` for many
    rows); the number replaced."""
    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, DenseLinear):
                full = f"{name}.{child_name}" if name else child_name
                amax = (input_amax or {}).get(full)
                setattr(module, child_name, Int8Linear(child.weight, child.bias, amax, ops, gemm))
                count += 1
    return count


def choose_int8_gemm(model: nn.Module, ops: Any, cache: Path | None = None) -> Int8Choice:
    """Measure (or read from `cache`, default: next to the kernels' build) the fastest int8
    GEMM on the shapes of the Int8Linear layers under `model`, log it, and make every
    layer use it."""
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    shapes: dict[tuple[int, int], list[Int8Linear]] = {}
    for layer in layers:
        shapes.setdefault(tuple(layer.weight_q.shape), []).append(layer)
    same = [(group[0].weight_q, len(group)) for group in shapes.values()]
    choice = choose_gemm(ops, same, cache or cache_dir() / CACHE_FILE)
    report(choice)
    for layer in layers:
        layer.use_gemm(choice.gemm)
    return choice
