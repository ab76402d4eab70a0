"""`pagedllm bench lora` on a tiny random Llama: the adapters it writes are PEFT's format
(PEFT loads them and computes what the merged baseline computes), the adapter assignment,
and the report's rows and ratios, computed from the runs' own counts. No timing is
asserted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_oracle import load_hf, load_hf_lora
from pagedllm.bench.lora_adapters import (
    TARGETS,
    AdapterSpec,
    assign_adapters,
    merge_adapter,
    write_adapters,
)
from pagedllm.errors import InvalidParameterError
from pagedllm.loader import load_model

PROMPT = torch.tensor([[3, 17, 42, 9, 101, 7]])


@pytest.mark.parametrize("rslora", [False, True])
def test_written_adapter_is_peft_and_merges_to_the_same_model(
    tiny_llama_dir: Path, tmp_path: Path, rslora: bool
) -> None:
    loaded = load_model(str(tiny_llama_dir))
    spec = AdapterSpec(rank=4, targets=TARGETS, alpha=8, rslora=rslora)
    (path,) = write_adapters(loaded.config, str(tmp_path), 1, spec, seed=3)
    with torch.inference_mode():
        peft_logits = load_hf_lora(tiny_llama_dir, Path(path))(PROMPT).logits
        merged = load_hf(tiny_llama_dir)
        weights = merge_adapter(loaded, path).weights
        state = merged.state_dict()
        merged.load_state_dict({k: weights[k] for k in state if k in weights}, strict=False)
        merged_logits = merged(PROMPT).logits
        base_logits = load_hf(tiny_llama_dir)(PROMPT).logits
    torch.testing.assert_close(merged_logits, peft_logits, rtol=1e-4, atol=1e-4)
    assert (peft_logits - base_logits).abs().max() > 1e-2  # the adapter changes the output


def test_adapter_spec_is_checked() -> None:
    with pytest.raises(InvalidParameterError, match="lm_head") as bad_targets:
        AdapterSpec(targets=("q_proj", "lm_head"))
    with pytest.raises(InvalidParameterError, match=r"1\.\.512") as bad_rank:
        AdapterSpec(rank=0)
    assert (bad_targets.value.param, bad_rank.value.param) == ("lora_targets", "lora_rank")
    assert AdapterSpec(rank=4, alpha=8).scaling == 2.0
    assert AdapterSpec(rank=4, alpha=8, rslora=True).scaling == 4.0


def test_assignment_is_seeded_and_zipf_is_skewed() -> None:
    uniform = assign_adapters(2000, 8, "uniform", seed=1)
    assert uniform == assign_adapters(2000, 8, "uniform", seed=1)
    assert set(uniform) == set(range(8))
    zipf = assign_adapters(2000, 8, "zipf", seed=1)
    counts = [zipf.count(k) for k in range(8)]
    assert counts[0] > 2 * counts[7] and counts[0] == max(counts)
    assert assign_adapters(5, 1, "zipf", seed=0) == [0] * 5
    with pytest.raises(InvalidParameterError, match="uniform, zipf"):
        assign_adapters(5, 2, "pareto", seed=0)
