"""The model's linear layers: dense, and int8 (W8A8) for CPUs.

`DenseLinear` holds float weights; the layer ops multiply. `Int8Linear` computes the same
product in int8: weights with one scale per output channel, and activations quantized at
every call with one scale per token (dynamic quantization); int8 x int8 products
accumulate in int32 and are rescaled to fp32. Per-token scales alone cost a small model
too much (SmolLM2-135M's perplexity rises about 4%): a few input channels carry outliers.
So each layer first moves part of its inputs' range into its weights (SmoothQuant: input
channel j is divided by s_j and the weights' column j multiplied by it, s_j =
max|x_j|^0.5 / max|W_j|^0.5, with max|x_j| observed on a short calibration text). The
compiled kernel (kernels/csrc/int8_linear.cpp) does a layer in one call; the pure-torch
path below computes the same numbers where it cannot run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

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
    ) -> None:
        """Quantize `weight` [out, in]; `input_amax` [in] (the largest |input| seen per
        channel) turns on smoothing; `ops` is the compiled kernels' namespace, if any."""
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
        self.weight_sums = self.weight_q.sum(dim=1, dtype=torch.int32)  # for the VNNI kernel
        self.weight_scale = scale.contiguous()
        self.inv_smooth = (1.0 / smooth).contiguous()
        self.bias = None if bias is None else bias.detach().float().cpu().contiguous()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        if self.ops is not None:
            return self.ops.int8_linear(
                x,
                self.inv_smooth,
                self.weight_q.t(),
                self.weight_scale,
                self.weight_sums,
                self.bias,
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
    model: nn.Module, input_amax: dict[str, torch.Tensor] | None = None, ops: Any = None
) -> int:
    """Replace every DenseLinear under `model` by an Int8Linear (smoothed where
    `input_amax`, from `observe_inputs`, has the layer); the number replaced."""
    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, DenseLinear):
                full = f"{name}.{child_name}" if name else child_name
                amax = (input_amax or {}).get(full)
                setattr(module, child_name, Int8Linear(child.weight, child.bias, amax, ops))
                count += 1
    return count
