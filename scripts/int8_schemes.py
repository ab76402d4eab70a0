"""Which int8 scheme: perplexity of the default model on the shipped text under each way
of quantizing its linear layers (docs/kernels.md's table).

The candidate schemes are simulated in float32 ("fake quantization": each weight and
input is rounded to its int8 grid and scaled back), with int8 weights per output channel
in every case; the shipped scheme (per-token activations, SmoothQuant-smoothed) is also
run through the real int8 path, `quantization="int8"`.
    .venv/bin/python scripts/int8_schemes.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.bench.options import get_loaded
from pagedllm.bench.quality import DATA, perplexity
from pagedllm.model.linear import DenseLinear
from pagedllm.worker.model_runner import TorchModelRunner
from pagedllm.worker.options import RunnerOptions

TEXT = DATA / "quality_text.txt"
Quantize = Callable[[torch.Tensor], torch.Tensor]


def rounded(x: torch.Tensor, amax: torch.Tensor, levels: int) -> torch.Tensor:
    scale = amax.clamp(min=1e-8) / levels
    return (x / scale).round().clamp(-levels, levels) * scale


def per_tensor(levels: int) -> Quantize:
    return lambda x: rounded(x, x.abs().amax(), levels)


def per_token(x: torch.Tensor) -> torch.Tensor:
    return rounded(x, x.abs().amax(dim=-1, keepdim=True), 127)


def fake_quantize(
    runner: TorchModelRunner, activations: Quantize, keep: tuple[str, ...] = ()
) -> None:
    """Every linear layer but those named in `keep` computes with int8-rounded weights
    (per output channel) and inputs rounded by `activations`."""
    for name, module in runner.model.named_modules():
        if not isinstance(module, DenseLinear) or name.endswith(keep):
            continue
        w = module.weight.detach()
        weight = rounded(w, w.abs().amax(dim=1, keepdim=True), 127)  # a copy: lm_head is tied
        bias = module.bias

        def forward(x: torch.Tensor, weight: torch.Tensor = weight, bias=bias) -> torch.Tensor:
            return F.linear(activations(x), weight, bias)

        module.forward = forward  # type: ignore[method-assign]


def text_perplexity(runner: TorchModelRunner, ids: list[int]) -> float:
    return perplexity(runner.logits_of(ids), ids)


def main() -> None:
    loaded = get_loaded(None)
    ids = loaded.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
    schemes: list[tuple[str, Quantize | None, tuple[str, ...]]] = [
        ("float32 (no quantization)", None, ()),
        ("per tensor, 8-bit", per_tensor(127), ()),
        ("per tensor, 7-bit", per_tensor(63), ()),
        ("per token, 8-bit", per_token, ()),
        ("per token, 8-bit, down projection kept fp32", per_token, ("down",)),
    ]
    rows = []
    for label, activations, keep in schemes:
        runner = TorchModelRunner(loaded, RunnerOptions())
        if activations is not None:
            fake_quantize(runner, activations, keep)
        rows.append((label, text_perplexity(runner, ids)))
    shipped = TorchModelRunner(loaded, RunnerOptions(quantization="int8"))
    label = "per token, 8-bit, SmoothQuant alpha 0.5 (quantization=int8)"
    rows.append((label, text_perplexity(shipped, ids)))
    base = rows[0][1]
    print(f"perplexity over {len(ids)} tokens of {TEXT.name}\n")
    print("| scheme | perplexity | change |\n|---|---|---|")
    for label, ppl in rows:
        print(f"| {label} | {ppl:.2f} | {ppl / base - 1:+.1%} |")


if __name__ == "__main__":
    main()
