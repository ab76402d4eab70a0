"""The int8 kernels one by one: every GEMM and gemv path equals the exact int32 product bit
for bit on odd shapes, the int8 layer equals the pure-torch one whichever GEMM it uses, the
choice among GEMMs is keyed and cached per machine, and PAGEDLLM_NO_VNNI=1 never reaches
torch's `_int_mm`. Behaviour only: no test here depends on a timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.kernels import int8_choice
from pagedllm.kernels.cpu import load_cpu_ops, missing_cpu_features
from pagedllm.kernels.policy import GEMV_MAX_ROWS, PANEL_GEMV_MAX_ROWS
from pagedllm.model.linear import Int8Linear

pytestmark = pytest.mark.skipif(bool(missing_cpu_features()), reason="no compiled kernels here")
ROWS = (1, 2, 3, 7, 8, 9, 33, 64, 100)
SHAPES = ((37, 13), (577, 41), (64, 24), (5, 3))  # (in, out): neither a tile multiple


def int8(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)


def kernels_for(rows: int) -> list[str]:
    """Every kernel for `rows` that any x86-64 CPU with AVX2 runs (the VNNI gemv: below)."""
    names = [*int8_choice.AVX2_GEMMS, "_int_mm", "auto"]
    return names + (["gemv avx2"] if rows <= GEMV_MAX_ROWS else [])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_every_kernel_equals_the_exact_product(rows: int, k: int, n: int) -> None:
    ops = load_cpu_ops()
    xq, w = int8((rows, k), rows), int8((n, k), k + n)
    exact = (xq.long() @ w.long().t()).int()
    sums = w.sum(dim=1, dtype=torch.int32)
    for kernel in kernels_for(rows):
        panel = int8_choice.AVX2_GEMMS.get(kernel)
        panels = None if panel is None else ops.int8_pack_panels(w, panel)
        assert torch.equal(ops.int8_matmul(xq, w.t(), sums, panels, kernel), exact), kernel


@pytest.mark.parametrize("rows", range(1, GEMV_MAX_ROWS + 1))
def test_the_vnni_gemv_equals_the_exact_product(rows: int) -> None:
    """The VNNI gemv, where the CPU has it; on one without, a skip says it was not run."""
    ops = load_cpu_ops()
    if not ops.int8_has_vnni()[0]:
        pytest.skip("this CPU has no AVX-512 VNNI")
    for k, n in SHAPES:
        xq, w = int8((rows, k), rows), int8((n, k), k + n)
        exact = (xq.long() @ w.long().t()).int()
        sums = w.sum(dim=1, dtype=torch.int32)
        assert torch.equal(ops.int8_matmul(xq, w.t(), sums, None, "gemv vnni"), exact), (k, n)


@pytest.mark.parametrize("rows", ROWS)
def test_the_layer_equals_the_torch_path_with_every_gemm(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(41, 577, generator=gen), torch.randn(41, generator=gen)
    x = torch.randn(rows, 577, generator=gen) * 3
    reference = Int8Linear(w, b, x.abs().amax(0))(x)
    for gemm in [*int8_choice.AVX2_GEMMS, "_int_mm", "auto"]:
        layer = Int8Linear(w, b, x.abs().amax(0), load_cpu_ops(), gemm)
        assert torch.equal(layer(x), reference), gemm


class FlagsOps:
    """The compiled ops with the CPU's VNNI flags replaced (cpu has it, kernels use it)."""

    def __init__(self, flags: tuple[bool, bool]) -> None:
        self.flags, self.ops = flags, load_cpu_ops()

    def int8_has_vnni(self) -> tuple[bool, bool]:
        return self.flags

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)


def fake_timer(seconds: dict[str, float], calls: list[str]) -> int8_choice.Timer:
    def timer(name: str, run: Any) -> float:
        calls.append(name)
        return seconds[name]

    return timer


def test_the_fastest_candidate_is_chosen_cached_and_reused(tmp_path: Path) -> None:
    layers = [(int8((24, 40), 0), 30), (int8((16, 24), 1), 1)]
    cache, calls = tmp_path / "choice.json", []
    seconds = {"fp32": 0.003, "gemm avx2": 0.002, "gemm avx2_int16": 0.001, "_int_mm": 0.004}
    ops = FlagsOps((True, True))
    choice = int8_choice.choose_gemm(ops, layers, cache, fake_timer(seconds, calls), "cpu A")
    assert choice.gemm == "gemm avx2_int16" and not choice.cached and choice.isa == "AVX-512 VNNI"
    assert choice.step_ms["_int_mm"] == pytest.approx(4 * 31) and choice.fp32_ms == 3 * 31
    assert not choice.slower_than_fp32() and "gemm avx2_int16" in choice.describe()
    assert set(calls) == {*seconds} and len(calls) == 3 * len(seconds) * len(layers)

    calls.clear()  # the same machine again: read back, nothing timed
    again = int8_choice.choose_gemm(ops, layers, cache, fake_timer(seconds, calls), "cpu A")
    assert again.cached and again.gemm == choice.gemm and again.step_ms == choice.step_ms
    assert calls == []

    # Another CPU model, or VNNI forced off: entries of their own, measured anew.
    slow = {**seconds, "fp32": 0.0001}
    other = int8_choice.choose_gemm(ops, layers, cache, fake_timer(slow, calls), "cpu B")
    assert calls and not other.cached and other.slower_than_fp32()
    calls.clear()
    forced = FlagsOps((True, False))
    no_vnni = int8_choice.choose_gemm(forced, layers, cache, fake_timer(seconds, calls), "cpu A")
    assert "_int_mm" not in calls and "_int_mm" not in no_vnni.step_ms
    assert no_vnni.isa == "AVX2" and not no_vnni.cached
    calls.clear()  # other shapes (another model): measured anew
    smaller = layers[:1]
    int8_choice.choose_gemm(ops, smaller, cache, fake_timer(seconds, calls), "cpu A")
    assert calls and len(json.loads(cache.read_text())) == 4


def test_a_later_candidate_must_win_by_the_margin() -> None:
    assert int8_choice.preferred({"a": 10.0, "b": 9.8, "c": 12.0}) == "a"
    assert int8_choice.preferred({"a": 10.0, "b": 9.0, "c": 12.0}) == "b"


def test_the_cache_key_names_the_machine_and_the_forcing() -> None:
    keys = {
        int8_choice.cache_key(cpu, has, use, "build", shapes)
        for cpu in ("cpu A", "cpu B")
        for has, use in ((True, True), (True, False), (False, False))
        for shapes in ([(8, 4, 2)], [(8, 4, 3)])
    }
    assert len(keys) == 12
    assert "_int_mm" not in int8_choice.candidates(vnni=False)
    assert "_int_mm" in int8_choice.candidates(vnni=True)


def test_no_vnni_never_reaches_int_mm(tmp_path: Path) -> None:
    """With PAGEDLLM_NO_VNNI=1 (read once per process: a subprocess), torch's `_int_mm` is
    replaced by one that fails; the choice, the "auto" kernel and the layers avoid it."""
    code = """
import sys, torch
from pathlib import Path
lib = torch.library.Library("aten", "IMPL")
def refuse(*args):
    raise AssertionError("_int_mm reached")
lib.impl("_int_mm", refuse, "CPU")
from pagedllm.kernels.cpu import load_cpu_ops
from pagedllm.model.linear import DenseLinear, choose_int8_gemm, quantize_linears
ops = load_cpu_ops()
assert ops.int8_has_vnni()[1] is False
model = torch.nn.Sequential(DenseLinear(40, 24), DenseLinear(24, 24))
for p in model.parameters():
    torch.nn.init.normal_(p)
quantize_linears(model, None, ops)
x = torch.randn(33, 40)
model(x)  # "auto"
choice = choose_int8_gemm(model, ops, Path(sys.argv[1]))
assert choice.gemm != "_int_mm" and "_int_mm" not in choice.step_ms
model(x)
ops.int8_matmul(torch.ones(64, 5, dtype=torch.int8), torch.ones(5, 3, dtype=torch.int8),
                torch.full((3,), 5, dtype=torch.int32), None, "auto")
print("ok", choice.gemm, "|", model[0].kernels)
"""
    env = {**os.environ, "PAGEDLLM_NO_VNNI": "1"}
    cache = str(tmp_path / "choice.json")
    out = subprocess.run(
        [sys.executable, "-c", code, cache], capture_output=True, text=True, env=env
    )
    # The GEMM is chosen by timing: every AVX2 candidate is possible, and each has its label.
    labels = {
        "gemm avx2": f"gemm avx2 panels up to {PANEL_GEMV_MAX_ROWS} rows, gemv avx2 up to "
        f"{GEMV_MAX_ROWS}, gemm avx2 above",
        "gemm avx2_int16": f"gemv avx2 up to {GEMV_MAX_ROWS} rows, gemm avx2_int16 above",
    }
    assert set(labels) == set(int8_choice.candidates(vnni=False))
    assert out.stdout.startswith("ok "), out.stderr
    gemm, label = out.stdout[3:].strip().split(" | ")
    assert label == labels[gemm]
