"""Every family from GGUF: a tiny random model of each (hf_oracle), written as llama.cpp's
converter writes it (gguf_convert), loads back to the same config and weights as its
Hugging Face directory, and the engine's greedy tokens from the GGUF equal transformers'
on the original model (batched; Gemma 3, windowed, also with chunked prefill and
preemption). Also: what GGUF cannot describe is refused clearly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_convert import write_gguf
from hf_oracle import hf_greedy, load_hf, make_tiny_model
from pagedllm import LLM, SamplingParams
from pagedllm.loader import ModelLoadError, load_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# llama.cpp's Gemma 3: one full layer in six, attention scale head_dim ** -0.5 (below 27B).
GEMMA_FOR_GGUF = dict(
    num_hidden_layers=6,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    query_pre_attn_scalar=16,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory):
    """A function: (HF dir, GGUF path) of a family's tiny model, built once."""
    built: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in built:
            folder = tmp_path_factory.mktemp(f"gguf-{arch}")
            extra = GEMMA_FOR_GGUF if arch == "gemma3" else {}
            hf_dir = make_tiny_model(folder / "hf", arch, seed=1, **extra)
            built[arch] = hf_dir, write_gguf(hf_dir, folder / f"{arch}.gguf")
        return built[arch]

    return get


@pytest.mark.parametrize("arch", FAMILIES)
def test_gguf_loads_the_same_model_as_its_hf_directory(arch: str, converted) -> None:
    hf_dir, path = converted(arch)
    from_hf, from_gguf = load_model(str(hf_dir)), load_model(str(path))
    # The tokenizer ids come from the GGUF's tokenizer metadata; the rest must agree.
    expected = dataclasses.replace(from_hf.config, eos_token_ids=from_gguf.config.eos_token_ids)
    assert from_gguf.config == expected
    assert sorted(from_gguf.weights) == sorted(from_hf.weights)
    offset = from_hf.config.norm_offset
    for name, tensor in from_hf.weights.items():
        got = from_gguf.weights[name]
        if offset and name.endswith("norm.weight"):
            # Stored as fl(1 + w), read back as fl(1 + w) - 1 (exact): what the model
            # computes with, w + 1, is the same float as from the checkpoint.
            got, tensor = got + offset, tensor + offset
        assert torch.equal(got, tensor), name


def test_the_windows_and_rope_bases_come_from_the_gguf(converted) -> None:
    gemma = load_model(str(converted("gemma3")[1])).config
    assert gemma.architecture == "gemma3_text"
    assert gemma.layer_windows == (8, 8, 8, 8, 8, None)
    assert (gemma.rope_theta, gemma.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert gemma.norm_offset == 1.0 and gemma.sandwich_norms and gemma.qk_norm
    assert gemma.attention_scale == 16**-0.5 and gemma.final_logit_softcapping == 30.0
    assert load_model(str(converted("phi3")[1])).config.layer_windows == (12, 12)
    assert load_model(str(converted("mistral")[1])).config.layer_windows == (8, 8)
    assert load_model(str(converted("qwen3")[1])).config.qk_norm


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 21, 37, 2)]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    kv = llm.engine.kv
    assert kv.allocator.num_free_blocks == kv.num_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_from_gguf_equals_transformers(arch: str, converted, prompts) -> None:
    hf_dir, path = converted(arch)
    hf = load_hf(hf_dir)
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    assert _generate(LLM(str(path), block_size=8, quantization="none"), prompts) == expected
    if arch == "gemma3":  # windows of 8 tokens, prompts past them
        # 60 blocks of 4 tokens over 6 layer groups (1 full, 5 windowed): one sequence
        # fits, the four at once do not.
        small = LLM(
            str(path),
            quantization="none",
            block_size=4,
            num_kv_blocks=60,
            watermark=0.0,
            max_num_batched_tokens=12,
        )
        assert _generate(small, prompts) == expected
        assert small.engine.scheduler.num_preemptions > 0


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gemma3_pattern_and_local_base_from_metadata(converted, tmp_path: Path) -> None:
    """Files that state the layer pattern and local rope base (as llama.cpp's newer
    converters may) are read, not overridden by llama.cpp's defaults."""
    src = gguf.GGUFReader(str(converted("gemma3")[1]))
    path = tmp_path / "patterned.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for key, field in src.fields.items():
        if key.startswith("gemma3."):
            value_type = field.types[0]
            writer.add_key_value(key, field.contents(), value_type)
    writer.add_sliding_window_pattern([True, False] * 3)
    writer.add_key_value("gemma3.rope.freq_base_swa", 20_000.0, gguf.GGUFValueType.FLOAT32)
    for t in src.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    _finish(writer)
    cfg = load_model(str(path)).config
    assert cfg.layer_windows == (8, None) * 3 and cfg.local_rope_theta == 20_000.0


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"rope_factors_long.weight": np.ones(8, np.float32)}, r"Phi-3's long-context rope"),
        ({"blk.0.ffn_gate_inp.weight": np.ones((4, 8), np.float32)}, r"unexpected tensor"),
    ],
)
def test_what_gguf_cannot_describe_is_refused(converted, tmp_path, extra, pattern) -> None:
    src = gguf.GGUFReader(str(converted("phi3")[1]))
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    for key, field in src.fields.items():
        if key.startswith("phi3."):
            writer.add_key_value(key, field.contents(), field.types[0])
    for t in src.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    for name, array in extra.items():
        writer.add_tensor(name, array)
    _finish(writer)
    with pytest.raises(ModelLoadError, match=pattern):
        load_model(str(path))
