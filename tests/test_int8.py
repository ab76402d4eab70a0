"""The int8 (W8A8) linear layers: the compiled kernel equals the pure-torch path to the
bit, both stay close to the float product, smoothing moves an input outlier into the
weights, and the engine option builds, runs and refuses what it cannot serve."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.errors import InvalidParameterError
from pagedllm.kernels.cpu import load_cpu_ops, missing_cpu_features
from pagedllm.model.linear import DenseLinear, Int8Linear, observe_inputs, quantize_linears


def weights(out_f: int, in_f: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=g) / in_f**0.5, torch.randn(out_f, generator=g)


@pytest.mark.skipif(bool(missing_cpu_features()), reason="no compiled kernels on this CPU")
@pytest.mark.parametrize(("rows", "in_f", "out_f"), [(1, 64, 96), (7, 576, 960), (33, 100, 24)])
def test_the_kernel_equals_the_torch_path_to_the_bit(rows: int, in_f: int, out_f: int) -> None:
    w, b = weights(out_f, in_f, rows)
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(1)) * 3
    x[0] = 0.0  # a row of zeros quantizes with scale 1, not a division by zero
    amax = x.abs().amax(0) + torch.rand(in_f)
    fast = Int8Linear(w, b, amax, load_cpu_ops())
    slow = Int8Linear(w, b, amax, None)
    assert torch.equal(fast(x), slow(x))
    assert torch.equal(fast(x)[0], b)


@pytest.mark.skipif(bool(missing_cpu_features()), reason="no compiled kernels on this CPU")
def test_the_avx2_path_equals_the_torch_path_too() -> None:
    """Where the CPU has AVX-512 VNNI the kernel uses it; the AVX2 path (gemv, the panels'
    few-row path, every GEMM) is checked apart, at every row count that picks a kernel."""
    code = """
import torch
from pagedllm.kernels.cpu import load_cpu_ops
from pagedllm.kernels.int8_choice import AVX2_GEMMS
from pagedllm.model.linear import Int8Linear
ops = load_cpu_ops()
assert ops.int8_has_vnni()[1] is False
g = torch.Generator().manual_seed(0)
w = torch.randn(96, 200, generator=g)
for rows in (1, 2, 3, 8, 9, 33):
    x = torch.randn(rows, 200, generator=g)
    for gemm in [*AVX2_GEMMS, "auto"]:
        assert torch.equal(Int8Linear(w, ops=ops, gemm=gemm)(x), Int8Linear(w)(x)), (rows, gemm)
print("ok")
"""
    env = {**os.environ, "PAGEDLLM_NO_VNNI": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "ok", out.stderr


def test_int8_stays_close_to_the_float_product() -> None:
    w, b = weights(256, 512, 0)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(2))
    exact = F.linear(x, w, b)
    got = Int8Linear(w, b, x.abs().amax(0))(x)
    assert ((got - exact).norm() / exact.norm()).item() < 0.02


def test_smoothing_tames_an_outlier_channel() -> None:
    """One input channel 100x larger than the rest: per-token scales alone lose the others;
    smoothing (calibrated on such inputs) keeps the error small."""
    w, _ = weights(128, 256, 3)
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(4))
    x[:, 7] *= 100.0
    exact = F.linear(x, w)

    def error(layer: Int8Linear) -> float:
        return ((layer(x) - exact).norm() / exact.norm()).item()

    assert error(Int8Linear(w, None, x.abs().amax(0))) < error(Int8Linear(w)) / 2


def test_observe_and_quantize_every_dense_layer() -> None:
    model = torch.nn.Sequential(DenseLinear(8, 16), torch.nn.ReLU(), DenseLinear(16, 4, True))
    for p in model.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(5, 8)
    amax = observe_inputs(model, lambda: model(x))
    assert set(amax) == {"0", "2"} and torch.equal(amax["0"], x.abs().amax(0))
    exact = model(x)
    assert quantize_linears(model, amax) == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[2], Int8Linear)
    assert ((model(x) - exact).norm() / exact.norm()).item() < 0.05


def test_the_engine_runs_int8_and_refuses_what_it_cannot(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), quantization="int8", num_kv_blocks=32, block_size=8)
    layer = llm.engine.runner.model.layers[0]
    assert isinstance(layer.qkv, Int8Linear) and isinstance(layer.down, Int8Linear)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
    assert llm.engine.kv.num_free_blocks == 32
    for bad in (dict(device="cuda"), dict(dtype="bfloat16"), dict(quantization="int4")):
        with pytest.raises(InvalidParameterError) as info:
            EngineConfig(**{"quantization": "int8", **bad})
        assert info.value.param == "quantization"


@pytest.mark.skipif(bool(missing_cpu_features()), reason="no compiled kernels on this CPU")
def test_no_rows_give_no_rows_on_every_path() -> None:
    """A step that only prefills part of a prompt asks the output layer for no logits: every
    kernel (and the torch path) returns [0, out] rather than reading rows that are not there."""
    ops = load_cpu_ops()
    w, _ = weights(40, 64, 0)
    layer, reference = Int8Linear(w, ops=ops), Int8Linear(w)
    none = torch.zeros(0, 64, dtype=torch.int8)
    for kernel in ("auto", "gemv avx2", "gemm avx2"):
        got = ops.int8_matmul(none, layer.weight_t, layer.weight_sums, None, kernel)
        assert got.shape == (0, 40)
    assert layer(torch.zeros(0, 64)).shape == reference(torch.zeros(0, 64)).shape == (0, 40)


def test_int8_prefills_a_long_prompt_in_chunks(tiny_llama_dir) -> None:
    """The prompt outgrows the step's token budget: its first steps produce no logits."""
    llm = LLM(
        str(tiny_llama_dir),
        quantization="int8",
        num_kv_blocks=32,
        block_size=8,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([list(range(30, 70))], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.kv.num_free_blocks == 32
