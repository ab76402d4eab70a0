"""An LLM that is dropped releases its engine, runner and KV pool at once, by reference
counting: no reference cycle keeps a pool (1 GiB by default) alive until the garbage
collector happens to run, whatever features the run used."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams


@pytest.mark.parametrize(
    "options",
    [{}, {"speculative_method": "ngram", "num_speculative_tokens": 2}, {"quantization": "int8"}],
    ids=["plain", "ngram", "int8"],
)
def test_a_dropped_llm_frees_its_engine_without_the_collector(
    tiny_llama_dir: Path, options: dict[str, Any]
) -> None:
    gc.collect()
    gc.disable()
    try:
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=4, **options)
        prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9]]
        llm.generate(prompts, SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=6))
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
        llm.beam_search([1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=4))
        engine = weakref.ref(llm.engine)
        kv_cache = weakref.ref(llm.engine.runner.kv_cache)
        del llm
        assert engine() is None and kv_cache() is None
    finally:
        gc.enable()
