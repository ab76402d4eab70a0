"""The fused element-wise kernels of a decoder layer equal the pure-torch reference ops:
RMS norm, residual add + norm (in place), rotary embedding (in place, on the fused QKV
projection) and SiLU-and-multiply; and a model on them gives the reference's tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu
from pagedllm.kernels.cpu import load_cpu_ops, missing_cpu_features
from pagedllm.kernels.policy import GEMV_MAX_ROWS
from pagedllm.model.config import ModelConfig
from pagedllm.model.layer_ops import CompiledLayerOps, TorchLayerOps
from pagedllm.model.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(bool(missing_cpu_features()), reason="no compiled kernels here")
TORCH = TorchLayerOps()


def compiled() -> CompiledLayerOps:
    return CompiledLayerOps(load_cpu_ops())


@pytest.mark.parametrize(("rows", "size"), [(1, 576), (7, 64), (33, 100)])
def test_norms_equal_the_reference(rows: int, size: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, res, w = (torch.randn(rows, size, generator=g) for _ in range(3))
    w = w[0]
    torch.testing.assert_close(compiled().rms_norm(x, w, 1e-5), TORCH.rms_norm(x, w, 1e-5))
    res_a, res_b = res.clone(), res.clone()
    out_a = compiled().add_rms_norm(x, res_a, w, 1e-5)
    out_b = TORCH.add_rms_norm(x, res_b, w, 1e-5)
    torch.testing.assert_close(out_a, out_b)
    assert torch.equal(res_a, res_b) and torch.equal(res_a, res + x)


@pytest.mark.parametrize("rows", range(1, GEMV_MAX_ROWS + 1))
def test_the_matrix_vector_kernel_equals_torch_for_each_row_count(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 200, generator=g), torch.randn(52, 200, generator=g), None
    for bias in (None, torch.randn(52, generator=g)):
        got = load_cpu_ops().dense_linear(x, w, bias)
        torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match=f"1 to {GEMV_MAX_ROWS} rows"):
        load_cpu_ops().dense_linear(torch.randn(GEMV_MAX_ROWS + 1, 200), w, b)


def test_the_build_key_covers_headers_and_the_policy(monkeypatch, tmp_path: Path) -> None:
    """A change to a header or to a rule the build bakes in builds anew."""
    shutil.copytree(cpu.CSRC, tmp_path / "csrc")
    monkeypatch.setattr(cpu, "CSRC", tmp_path / "csrc")
    first = cpu.build_directory()
    header = tmp_path / "csrc" / "row_dispatch.h"
    header.write_text(header.read_text() + "\n// changed\n")
    second = cpu.build_directory()
    assert second != first
    flags = [f for f in cpu.FLAGS if not f.startswith("-DPAGEDLLM_GEMV_MAX_ROWS=")]
    monkeypatch.setattr(cpu, "FLAGS", [*flags, "-DPAGEDLLM_GEMV_MAX_ROWS=4"])
    assert cpu.build_directory() not in (first, second)


def test_rotary_and_silu_equal_the_reference() -> None:
    cfg = ModelConfig("llama", 100, 96, 64, 1, 6, 2, 16, rope_theta=10000.0)
    rope = RotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, (6 + 2 * 2) * 16, generator=g)
    positions = torch.tensor([0, 1, 5, 9, 100, 200, 3, 3, 511])
    a, b = qkv.clone(), qkv.clone()
    compiled().rotary(positions, a, rope.cos, rope.sin, 6, 2, 16)
    TORCH.rotary(positions, b, rope.cos, rope.sin, 6, 2, 16)
    torch.testing.assert_close(a, b)
    assert torch.equal(a[:, (6 + 2) * 16 :], qkv[:, (6 + 2) * 16 :])  # V is left alone
    gate_up = torch.randn(5, 2 * 40, generator=g) * 4
    torch.testing.assert_close(compiled().silu_and_mul(gate_up), TORCH.silu_and_mul(gate_up))


def test_the_model_on_fused_ops_generates_the_references_tokens(tiny_llama_dir) -> None:
    prompts = [[1, 2, 3, 4, 5], [7] * 30, [9, 8]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "auto"):  # the whole pure-torch path; the compiled one
        llm = LLM(str(tiny_llama_dir), attention_backend=backend, max_num_batched_tokens=16)
        assert llm.engine.runner.model.ops.name == (
            "torch" if backend == "reference" else "compiled"
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert tokens["auto"] == tokens["reference"]
