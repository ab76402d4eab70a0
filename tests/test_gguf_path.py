"""quantization="gguf": a GGUF's linear weights stay its blocks and the layers compute on them.

A tiny Llama GGUF is written here with the `gguf` package: Q8_0, Q4_0 and Q4_1 matrices (a
fused q/k/v of mixed types; Q/K rows permuted as llama.cpp's converter does), a Q8_0 tied
embedding, F32 norms. Each GGUF layer (compiled op and pure-torch fallback) equals the
dequantized weights times the dequantized quantized activations; the engine's greedy tokens
mostly agree with the exact (dequantized) path's and the KV pool ends whole; the weights are
views of the memory-mapped file (no fp32 copy); what cannot run is refused naming
`quantization`. And the real default model (slow) answers on its Q4_1 blocks.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_convert import write_gguf
from hf_oracle import make_tiny_model
from pagedllm import LLM, SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.errors import InvalidParameterError
from pagedllm.kernels.cpu import load_cpu_ops, missing_cpu_features
from pagedllm.kernels.gguf_blocks import INTERLEAVED_GROUP_ROWS, INTERLEAVED_TYPES
from pagedllm.loader import LoadedModel, load_model
from pagedllm.loader.gguf_loader import release_pages
from pagedllm.model.gguf_linear import GGUFLinear, GGUFWeight, embed_rows, quantized_activations
from pagedllm.worker.factory import build_runner
from pagedllm.worker.options import RunnerOptions
from tiny_gguf import HIDDEN, LAYERS, VOCAB, write_tiny_llama_gguf

# Per layer: the matrices' types (q/k/v mixed, gate/up one type).
KINDS = {
    "attn_q": "Q8_0",
    "attn_k": "Q4_0",
    "attn_v": "Q4_1",
    "attn_output": "Q4_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_1",
    "ffn_down": "Q8_0",
}
COMPILED = pytest.param(
    "compiled", marks=pytest.mark.skipif(bool(missing_cpu_features()), reason="no kernels")
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf_path") / "tiny.gguf"
    write_tiny_llama_gguf(path, KINDS, context_length=256)
    return path


@pytest.fixture(scope="module")
def exact(model_path: Path) -> LoadedModel:
    return load_model(str(model_path))


@pytest.fixture(scope="module")
def kept(model_path: Path) -> LoadedModel:
    return load_model(str(model_path), keep_quantized=True)


def _linears(runner_model: torch.nn.Module) -> dict[str, tuple[GGUFLinear, list[str]]]:
    """Each GGUF layer of the model with the Hugging Face names of its stacked parts."""
    layers = {"lm_head": (runner_model.lm_head, ["model.embed_tokens.weight"])}
    for i, layer in enumerate(runner_model.layers):
        p = f"model.layers.{i}."
        layers[f"{i}.qkv"] = (layer.qkv, [f"{p}self_attn.{n}_proj.weight" for n in "qkv"])
        layers[f"{i}.o_proj"] = (layer.o_proj, [f"{p}self_attn.o_proj.weight"])
        layers[f"{i}.gate_up"] = (
            layer.gate_up,
            [f"{p}mlp.{n}_proj.weight" for n in ("gate", "up")],
        )
        layers[f"{i}.down"] = (layer.down, [f"{p}mlp.down_proj.weight"])
    return layers


@pytest.mark.parametrize("kernels", [COMPILED, "torch"])
def test_each_layer_is_the_dequantized_product(
    exact: LoadedModel, kept: LoadedModel, kernels: str
) -> None:
    runner, _ = build_runner(RunnerOptions(quantization="gguf"), loaded=kept)
    model = runner.model
    ops = load_cpu_ops() if kernels == "compiled" else None
    rng = torch.Generator().manual_seed(0)
    for name, (layer, parts) in _linears(model).items():
        assert isinstance(layer, GGUFLinear), name
        layer.kernels = ops
        assert [p.shape for p in layer.parts] == [tuple(exact.weights[n].shape) for n in parts]
        for rows in (1, 3, 9):
            x = torch.randn(rows, layer.in_features, generator=rng)
            got = layer(x).double()
            want, bound = [], []
            for part, hf in zip(layer.parts, parts, strict=True):
                xq = quantized_activations(x, part.ggml_type).double()
                w = exact.weights[hf].double()  # the exact path's (dequantized) weight
                want.append(xq @ w.T)
                bound.append(xq.abs() @ w.abs().T)
            err = (got - torch.cat(want, -1)).abs()
            assert (err <= 1e-5 * torch.cat(bound, -1) + 1e-7).all(), (name, rows)
    ids = torch.tensor([3, 95, 3, 0])
    table = model.embed_tokens
    assert isinstance(table, GGUFWeight)
    for kernels in (None, ops):  # gguf-py's numpy, the compiled op
        torch.testing.assert_close(
            embed_rows(ids, table, kernels),
            exact.weights["model.embed_tokens.weight"][ids],
            rtol=0,
            atol=0,
        )


def _greedy(loaded: LoadedModel, prompts: list[list[int]], **options) -> list[list[int]]:
    llm = LLM(loaded=loaded, kv_cache_memory="4MiB", **options)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    kv = llm.engine.kv
    assert kv.allocator.num_free_blocks == kv.num_blocks  # nothing leaked
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_tokens_mostly_agree_with_the_exact_path(
    exact: LoadedModel, kept: LoadedModel
) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 9, 17, 30, 2, 12, 40, 7)]
    want = _greedy(exact, prompts, quantization="none")
    got = _greedy(kept, prompts, quantization="gguf")
    pairs = [list(zip(g, w, strict=True)) for g, w in zip(got, want, strict=True)]
    prefix = [next((i for i, (a, b) in enumerate(p) if a != b), 16) for p in pairs]
    same = sum(a == b for p in pairs for a, b in p) / (16 * len(prompts))
    # Measured: 95% of the tokens, 7 of 8 prompts equal throughout.
    assert same >= 0.8, (same, prefix)
    assert sum(p == 16 for p in prefix) >= len(prompts) // 2, (same, prefix)


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps the file at `path`."""
    ranges = []
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            if line.rstrip().endswith(str(path)):
                start, end = (int(a, 16) for a in line.split()[0].split("-"))
                ranges.append((start, end))
    return ranges


def _resident_kb(path: Path) -> int:
    """KiB of the file at `path` resident in this process's mappings of it."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_a_copied_tensors_pages_in_the_map_are_handed_back(tmp_path: Path) -> None:
    """What the loader does after permuting Q/K rows into a copy: the source's whole pages
    stop counting in resident memory, and read the same bytes if touched again."""
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(64 * 4096))
    blob = np.memmap(path, dtype=np.uint8, mode="c").view(np.ndarray)
    before = int(blob.sum())  # every page read
    assert _resident_kb(path.resolve()) == 64 * 4
    release_pages(blob[8 * 4096 + 100 : 40 * 4096 + 100])  # 31 whole pages inside
    assert _resident_kb(path.resolve()) == (64 - 31) * 4
    assert int(blob.sum()) == before


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_weights_are_views_of_the_mapped_file(model_path: Path, kept: LoadedModel) -> None:
    runner, _ = build_runner(RunnerOptions(quantization="gguf"), loaded=kept)
    model = runner.model
    ranges = _mapped_ranges(model_path.resolve())
    assert ranges

    def mapped(t: torch.Tensor) -> bool:
        start, end = t.data_ptr(), t.data_ptr() + t.numel()
        return any(lo <= start and end <= hi for lo, hi in ranges)

    assert mapped(model.embed_tokens.blocks)
    for name, (layer, parts) in _linears(model).items():
        for part, hf in zip(layer.parts, parts, strict=True):
            # Q/K rows are permuted back into a copy of their tensor, and Q4_1/Q4_K parts
            # in whole groups of rows interleaved into one; all else is the map.
            copied = part.interleaved or hf.endswith(("q_proj.weight", "k_proj.weight"))
            assert mapped(part.blocks) != copied, (name, hf)
            assert part.interleaved == (
                part.ggml_type in INTERLEAVED_TYPES
                and all(p.shape[0] % INTERLEAVED_GROUP_ROWS == 0 for p in layer.parts)
            )
    # The model's only parameters: its norms (no fp32 copy of a weight matrix).
    assert sum(p.numel() for p in model.parameters()) == (2 * LAYERS + 1) * HIDDEN


def test_refusals(tmp_path: Path, tiny_llama_dir: Path) -> None:
    with pytest.raises(InvalidParameterError) as err:
        LLM(model=str(tiny_llama_dir), quantization="gguf")
    assert err.value.param == "quantization"
    odd = tmp_path / "q5_1.gguf"
    write_tiny_llama_gguf(odd, {**KINDS, "ffn_down": "Q5_1"}, context_length=256)
    with pytest.raises(InvalidParameterError, match="Q5_1") as err:
        LLM(model=str(odd), quantization="gguf")
    assert err.value.param == "quantization"
    for options, param in (
        ({"tensor_parallel_size": 2}, "quantization"),
        ({"dtype": "bfloat16"}, "quantization"),
    ):
        with pytest.raises(InvalidParameterError) as err:
            EngineConfig(quantization="gguf", **options)
        assert err.value.param == param


@pytest.mark.slow
def test_default_model_on_its_q4_1_blocks_answers_paris() -> None:
    llm = LLM(quantization="gguf", kv_cache_memory="64MiB")
    layer = llm.engine.runner.model.layers[0].gate_up
    assert isinstance(layer, GGUFLinear)
    assert {p.ggml_type.name for p in layer.parts} == {"Q4_1"}
    system = "You are a helpful assistant. Answer in one short sentence."  # as `make run`
    msgs = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3"])
def test_every_family_from_f16_blocks_gives_the_exact_path_logits(
    arch: str, tmp_path: Path
) -> None:
    """F16 weights multiply fp32 inputs unquantized, so the GGUF layers compute what the
    exact path computes: the families' rewrites (Q/K permutation, Phi-3's fused tensors,
    Gemma's norms and embedding scale, Qwen2's q/k/v biases) must all come out the same."""
    extra = {"num_hidden_layers": 6, "query_pre_attn_scalar": 16} if arch == "gemma3" else {}
    if arch == "gemma3":
        extra["layer_types"] = ["sliding_attention"] * 5 + ["full_attention"]
    path = write_gguf(
        make_tiny_model(tmp_path / "hf", arch, seed=1, **extra), tmp_path / "m.gguf", "F16"
    )
    exact_model = load_model(str(path))
    ids = np.random.default_rng(2).integers(3, exact_model.config.vocab_size, size=40).tolist()
    want, _ = build_runner(RunnerOptions(quantization="none"), loaded=exact_model)
    kept = load_model(str(path), keep_quantized=True)
    assert isinstance(kept.weights["model.layers.0.mlp.up_proj.weight"], GGUFWeight)
    got, _ = build_runner(RunnerOptions(quantization="gguf"), loaded=kept)
    torch.testing.assert_close(got.logits_of(ids), want.logits_of(ids), rtol=1e-4, atol=1e-4)
