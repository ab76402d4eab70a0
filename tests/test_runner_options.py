"""The runner's own options and the small contracts around the runners: RunnerOptions
validates like the engine's config and is read from it by name; a tensor-parallel rank
runs only the runner methods on its allow-list; the fake runner sizes blocks by its
bytes per token."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm.engine.config import EngineConfig
from pagedllm.errors import InvalidParameterError
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.options import RunnerOptions
from pagedllm.worker.runner import ModelSpec
from pagedllm.worker.tp_worker import RANK_METHODS, Call


def test_options_are_read_from_the_engine_config_by_name() -> None:
    config = EngineConfig(dtype="bfloat16", kv_cache_dtype="float16", seed=7, device="cpu")
    options = RunnerOptions.of(config)
    for field in dataclasses.fields(RunnerOptions):
        assert getattr(options, field.name) == getattr(config, field.name)
    rank = RunnerOptions(tensor_parallel_size=2).for_rank("cuda:1")
    assert (rank.device, rank.tensor_parallel_size) == ("cuda:1", 1)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"dtype": "float64"}, "dtype"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"quantization": "int4"}, "quantization"),
        ({"quantization": "int8", "dtype": "float16"}, "quantization"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size"),
        ({"tensor_parallel_size": 2, "device": "cuda:0"}, "device"),
    ],
)
def test_bad_options_name_the_option(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        RunnerOptions(**kwargs)
    assert info.value.param == param


def test_ranks_run_only_the_allowed_runner_methods() -> None:
    assert sorted(RANK_METHODS) == ["execute", "init_kv_cache", "logits_of"]
    assert Call("init_kv_cache", (4, 16)).args == (4, 16)
    with pytest.raises(ValueError, match="not a rank method"):
        Call("shutdown", ())


def test_the_fake_runner_sizes_a_block_by_its_bytes_per_token() -> None:
    spec = ModelSpec(vocab_size=10, max_position_embeddings=64)
    assert FakeModelRunner(spec).kv_bytes_per_block(16) == 16
    assert FakeModelRunner(spec, kv_bytes_per_token=46080).kv_bytes_per_block(16) == 16 * 46080
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        FakeModelRunner(spec, kv_bytes_per_token=0)
