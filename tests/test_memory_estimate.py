"""The memory check before a model loads (loader/memory_estimate.py, engine/memory_check.py).

A tiny Llama GGUF (Q8_0 and Q4_0 matrices, Q/K rows to permute, a tied Q8_0 embedding,
F32 norms) and a tiny Hugging Face directory: the estimate's weights equal the bytes the
loaded model holds on each path (fp32, gguf, int8), its KV pool the pool the engine
allocates; a model whose estimate exceeds the available memory (a stand-in for
/proc/meminfo) is refused naming the figures, before the loader is called; the CLI exits 2
with one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import LLM
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.memory_check import estimate, kv_pool_bytes
from pagedllm.entrypoints.cli import main
from pagedllm.errors import InsufficientMemoryError
from pagedllm.loader import load_model
from pagedllm.loader import memory_estimate as memory
from pagedllm.model.gguf_linear import GGUFLinear, GGUFWeight
from pagedllm.model.linear import Int8Linear
from pagedllm.worker.model_runner import TorchModelRunner
from pagedllm.worker.options import RunnerOptions


@pytest.fixture
def model_path(tiny_quantized_gguf: Path) -> Path:
    return tiny_quantized_gguf


def held_bytes(modules: Iterable[torch.nn.Module]) -> int:
    """The bytes of every weight `modules` hold, each tensor once: parameters, GGUF blocks,
    int8 layers' tensors (the AVX2 GEMM's optional panels aside); not the rotary tables."""
    tensors: dict[int, torch.Tensor] = {}
    for module in modules:
        found = list(module.parameters(recurse=False))
        if isinstance(module, GGUFLinear):
            found += [part.blocks for part in module.parts]
        if isinstance(getattr(module, "embed_tokens", None), GGUFWeight):
            found.append(module.embed_tokens.blocks)
        if isinstance(module, Int8Linear):
            found += [module.weight_q, module.weight_sums, module.weight_scale, module.inv_smooth]
            found += [module.bias] if module.bias is not None else []
        tensors.update({t.data_ptr(): t for t in found})
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("quantization", ["none", "gguf", "int8"])
def test_weights_estimate_is_what_the_loaded_model_holds(model_path, quantization) -> None:
    header = memory.read_model_header(str(model_path))
    loaded = load_model(str(model_path), keep_quantized=quantization == "gguf")
    runner = TorchModelRunner(loaded, RunnerOptions(quantization=quantization))
    held = held_bytes(runner.model.modules())
    params = sum(int(np.prod(t.shape)) for t in loaded.weights.values())
    if quantization == "gguf":
        # The Q and K blocks are permuted copies; the map's own bytes stay mapped beside them.
        qk = [
            w for n, w in loaded.weights.items() if n.endswith(("q_proj.weight", "k_proj.weight"))
        ]
        held += sum(w.blocks.numel() for w in qk)
        blocks = [w for w in loaded.weights.values() if isinstance(w, GGUFWeight)]
        dense = params - sum(int(np.prod(w.shape)) for w in blocks)
        loading = held + 4 * dense  # the loader's fp32 norms beside the model's
    elif quantization == "int8":
        int8 = [m for m in runner.model.modules() if isinstance(m, Int8Linear)]
        loading = 2 * 4 * params + held_bytes(int8)  # the loader's and the model's fp32
    else:
        assert held == 4 * params
        loading = 2 * held
    weights = memory.weight_memory(header, quantization, 4)
    assert (weights.held, weights.loading) == (held, loading)


def test_hf_directory_estimate_reads_the_safetensors_headers(tiny_llama_dir) -> None:
    header = memory.read_model_header(str(tiny_llama_dir))
    loaded = load_model(str(tiny_llama_dir))
    runner = TorchModelRunner(loaded, RunnerOptions(quantization="none"))
    assert memory.weight_memory(header, "none", 4).held == held_bytes(runner.model.modules())


@pytest.mark.parametrize(
    "options", [dict(num_kv_blocks=37), dict(kv_cache_memory="1MiB", kv_cache_dtype="float16")]
)
def test_kv_pool_estimate_is_the_pool_the_engine_allocates(model_path, options) -> None:
    config = EngineConfig(model=str(model_path), **options)
    header = memory.read_model_header(str(model_path))
    llm = LLM(str(model_path), **options)
    data = llm.engine.runner.kv_cache.data
    assert kv_pool_bytes(config, header) == data.numel() * data.element_size()


def test_kv_pool_estimate_of_a_hybrid_model(family_dir) -> None:
    """Gemma 3's sliding-window layers: blocks of one layer group, and the null block."""
    path = str(family_dir("gemma3"))
    header = memory.read_model_header(path)
    assert header.config.layer_windows is not None
    llm = LLM(path, num_kv_blocks=37)
    data = llm.engine.runner.kv_cache.data
    config = EngineConfig(model=path, num_kv_blocks=37)
    assert kv_pool_bytes(config, header) == data.numel() * data.element_size()


def _loader_must_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the loader ran before the memory check")

    monkeypatch.setattr("pagedllm.worker.factory.load_model", refuse)


def test_a_model_that_does_not_fit_is_refused_before_loading(model_path, monkeypatch) -> None:
    """Room for the gguf path's blocks and 64 KiB of KV pool, not for the fp32 weights."""
    limits = dict(max_num_seqs=4, max_num_batched_tokens=16, quantization="none")
    config = EngineConfig(model=str(model_path), **limits)
    header = memory.read_model_header(str(model_path))
    need, blocks = estimate(config, header, "none"), estimate(config, header, "gguf")
    available = blocks.weights.held + blocks.buffers + 64 * 2**10
    assert available < need.weights.held + need.buffers
    monkeypatch.setattr(memory, "available_memory", lambda: available)
    _loader_must_not_run(monkeypatch)
    with pytest.raises(InsufficientMemoryError) as info:
        LLM(str(model_path), **limits)
    assert info.value.param == "model"
    size = memory.format_bytes
    assert str(info.value) == (
        f"{model_path} needs {size(need.peak)} at its peak: weights {size(need.weights.held)} "
        f"({size(need.weights.loading)} while loading), KV pool {size(need.kv_pool)}, "
        f"buffers {size(need.buffers)}; the machine has {size(available)} available. "
        "To fit: --quantization gguf with a KV pool of at most 64.0 KiB (--kv-cache-memory)."
    )


def test_a_kv_pool_that_does_not_fit_names_kv_cache_memory(model_path, monkeypatch) -> None:
    options = dict(kv_cache_memory="2GiB", quantization="none")
    config = EngineConfig(model=str(model_path), **options)
    need = estimate(config, memory.read_model_header(str(model_path)), "none")
    available = need.weights.held + need.buffers + 2**30
    monkeypatch.setattr(memory, "available_memory", lambda: available)
    _loader_must_not_run(monkeypatch)
    with pytest.raises(InsufficientMemoryError) as info:
        LLM(str(model_path), **options)
    assert info.value.param == "kv_cache_memory"
    assert "To fit: a KV pool of at most 1.00 GiB (--kv-cache-memory); or" in str(info.value)


def test_cli_exits_2_with_one_line(model_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(memory, "available_memory", lambda: 2**20)
    _loader_must_not_run(monkeypatch)
    assert main(["generate", "--model", str(model_path), "hi"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the estimate's INFO line
    assert last.startswith("pagedllm generate: error: ") and "needs" in last, last
    assert "the machine has 1.0 MiB available" in last


def test_available_memory_is_meminfo_or_the_cgroup_limit_when_lower(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2000 kB\nMemAvailable:   1000 kB\n")
    group = tmp_path / "cgroup"
    group.mkdir()
    (group / "memory.max").write_text("max\n")
    (group / "memory.current").write_text("300000\n")
    (group / "memory.stat").write_text("anon 200000\ninactive_file 100000\n")
    assert memory.available_memory(meminfo, group) == 1000 * 1024
    (group / "memory.max").write_text("500000\n")  # less what it uses, its idle cache aside
    assert memory.available_memory(meminfo, group) == 500000 - (300000 - 100000)
    assert memory.available_memory(tmp_path / "none", tmp_path / "none") is None
