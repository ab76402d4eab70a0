"""PEFT adapters read and checked against the base (refusals name the field or the
tensor), their pages in the KV pool (a round trip, also through a pool of another dtype),
the row tiles of a mixed batch, and the fake runner's sizing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_oracle import make_lora_adapter, make_tiny_model
from pagedllm.errors import InvalidParameterError
from pagedllm.loader import load_model
from pagedllm.lora.adapter import load_adapter, unpack
from pagedllm.lora.batch import plan_rows
from pagedllm.lora.peft_config import TARGETS, read_peft_config
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.kv_cache import PagedKVCache
from pagedllm.worker.lora_pages_io import page_floats, read_adapter, write_adapter
from pagedllm.worker.options import RunnerOptions
from pagedllm.worker.runner import ModelSpec


@pytest.fixture(scope="module")
def qv(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora_adapter(tiny_llama_dir, tmp_path_factory.mktemp("qv") / "a", seed=1, r=8)


def _edited(src: Path, dst: Path, **changes) -> Path:
    """A copy of adapter `src` at `dst` with its config's fields changed."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_weights_are_fp32_with_the_scaling_folded_into_b(tiny_llama_dir: Path, qv: Path) -> None:
    from safetensors.torch import load_file

    cfg = load_model(str(tiny_llama_dir)).config
    adapter = load_adapter(str(qv), cfg, max_lora_rank=16)
    assert adapter.config.targets == ("q_proj", "v_proj")
    assert adapter.config.scaling == 1.0  # alpha 8 / r 8
    raw = load_file(str(qv / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_{}.weight"
    assert torch.equal(adapter.a["v_proj"][1], raw[name.format("A")])
    assert torch.equal(adapter.b["v_proj"][1], raw[name.format("B")])
    a, b = unpack(adapter.pack(), cfg, 8, adapter.config.targets)
    assert all(torch.equal(a[t], adapter.a[t]) and torch.equal(b[t], adapter.b[t]) for t in a)


def test_rslora_scales_by_alpha_over_sqrt_r(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = make_lora_adapter(tiny_llama_dir, tmp_path / "rs", r=4, alpha=6, rslora=True)
    config, _ = read_peft_config(path, 2, 16)
    assert config.scaling == 3.0


def test_a_rank_above_max_lora_rank_is_refused(qv: Path, tiny_llama_dir: Path) -> None:
    cfg = load_model(str(tiny_llama_dir)).config
    with pytest.raises(InvalidParameterError) as info:
        load_adapter(str(qv), cfg, max_lora_rank=4)
    assert info.value.param == "max_lora_rank"
    assert "rank 8" in str(info.value) and "max_lora_rank 4" in str(info.value)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"target_modules": ["q_proj", "lm_head"]}, "'lm_head'"),
        ({"target_modules": ["embed_tokens"]}, "'embed_tokens'"),
        ({"target_modules": ".*lm_head"}, "'lm_head'"),
        ({"target_modules": ".*nothing"}, "matches no layer"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"use_dora": True}, "use_dora"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"layers_to_transform": [5]}, "layers_to_transform"),
    ],
)
def test_unsupported_options_are_refused_by_name(
    qv: Path, tiny_llama_dir: Path, tmp_path: Path, changes: dict, named: str
) -> None:
    cfg = load_model(str(tiny_llama_dir)).config
    with pytest.raises(InvalidParameterError) as info:
        load_adapter(str(_edited(qv, tmp_path / "bad", **changes)), cfg, 16)
    assert info.value.param == "lora_path"
    assert named in str(info.value)


def test_tensors_that_do_not_fit_the_base_are_refused_by_name(
    tiny_llama_dir: Path, tmp_path: Path, qv: Path
) -> None:
    cfg = load_model(str(tiny_llama_dir)).config
    other = make_tiny_model(tmp_path / "wide", intermediate_size=96)
    wide = make_lora_adapter(other, tmp_path / "wide-a", targets=("q_proj", "down_proj"))
    with pytest.raises(InvalidParameterError) as info:
        load_adapter(str(wide), cfg, 16)
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight" in str(info.value)
    assert "(4, 96)" in str(info.value) and "(4, 128)" in str(info.value)
    # a tensor the config does not name, and one it names that is missing
    fewer = _edited(qv, tmp_path / "fewer", target_modules=["q_proj"])
    with pytest.raises(InvalidParameterError) as info:
        load_adapter(str(fewer), cfg, 16)
    assert "layers.0.self_attn.v_proj.lora_A.weight" in str(info.value)
    more = _edited(qv, tmp_path / "more", target_modules=["q_proj", "v_proj", "o_proj"])
    with pytest.raises(InvalidParameterError) as info:
        load_adapter(str(more), cfg, 16)
    assert "layers.0.self_attn.o_proj.lora_A.weight is missing" in str(info.value)
    with pytest.raises(InvalidParameterError) as info:
        load_adapter(str(tmp_path), cfg, 16)
    assert "adapter_config.json" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_round_trip(tiny_llama_dir: Path, qv: Path, dtype: torch.dtype) -> None:
    """An adapter written into pages reads back bit for bit, beside K/V it leaves alone,
    also in a pool of another dtype (its bytes hold the float32 values)."""
    cfg = load_model(str(tiny_llama_dir)).config
    packed = load_adapter(str(qv), cfg, 16).pack()
    cache = PagedKVCache(cfg, 10, 8, dtype=dtype)
    cache.data.normal_()
    before = cache.data.clone()
    page = page_floats(8, cfg.num_key_value_heads, cfg.head_dim, dtype.itemsize)
    pages = (7, 2, 5, 3, 9, 0, 8, 1)[: -(-packed.shape[1] // page)]
    write_adapter(cache, packed, pages)
    assert torch.equal(read_adapter(cache, pages, packed.shape[1]), packed)
    others = [b for b in range(10) if b not in pages]
    assert torch.equal(cache.data[:, :, others], before[:, :, others])


def test_rows_are_grouped_into_tiles_of_one_adapter() -> None:
    slots = torch.tensor([-1, 0, 1, 0, 0, -1, 1, 0, 0])
    tiles = plan_rows(slots, num_slots=2, max_tile=2)
    assert tiles is not None
    assert (tiles.tiles, tiles.rows_per_tile) == (4, 2)
    assert tiles.tile_slot.tolist() == [0, 0, 0, 1]
    # slot 0's rows 1, 3, 4, 7, 8 in order over three tiles (the last padded), then slot 1's
    assert tiles.gather[tiles.src].tolist() == [1, 3, 4, 7, 8, 2, 6]
    assert tiles.dst.tolist() == [1, 3, 4, 7, 8, 2, 6]
    assert tiles.src.tolist() == [0, 1, 2, 3, 4, 6, 7]
    one_each = plan_rows(torch.tensor([1, -1, 0]), num_slots=2)
    assert one_each is not None and one_each.tile_slot is None  # tile i is slot i
    assert one_each.src is None and one_each.dst.tolist() == [2, 0]  # no padding
    assert plan_rows(torch.tensor([-1, -1]), num_slots=1) is None


def test_fake_runner_sizes_adapters_from_their_config(qv: Path) -> None:
    runner = FakeModelRunner(ModelSpec(128, 512, num_layers=2), max_lora_rank=16)
    # rank 8 on 2 targets at 64 bytes each: 1024 bytes; a block of 16 tokens: 16 bytes
    assert runner.adapter_pages(str(qv), 16) == 64
    assert runner.max_adapter_pages(16) == 16 * len(TARGETS) * 64 // 16
    with pytest.raises(InvalidParameterError) as info:
        FakeModelRunner(ModelSpec(128, 512, num_layers=2), max_lora_rank=4).adapter_pages(
            str(qv), 16
        )
    assert info.value.param == "max_lora_rank"
    runner.drop_adapter(3)
    assert runner.dropped_adapters == [3]


def test_runner_options() -> None:
    assert RunnerOptions(enable_lora=True).draft_options().enable_lora is False
    for bad in (dict(max_lora_rank=0), dict(max_lora_rank=513), dict(max_cpu_loras=0)):
        with pytest.raises(InvalidParameterError) as info:
            RunnerOptions(**bad)
        assert info.value.param == next(iter(bad))
    with pytest.raises(InvalidParameterError) as info:
        RunnerOptions(enable_lora=True, tensor_parallel_size=2)
    assert info.value.param == "enable_lora"
