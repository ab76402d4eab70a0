"""`pagedllm bench lora` on a tiny random Llama: the adapters it writes are PEFT's format
(PEFT loads them and computes what the merged baseline computes), the adapter assignment,
and the report's rows and ratios, computed from the runs' own counts. No timing is
asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench_results import COMMON_KEYS
from hf_oracle import load_hf, load_hf_lora
from pagedllm.bench.lora_adapters import (
    TARGETS,
    AdapterSpec,
    assign_adapters,
    merge_adapter,
    write_adapters,
)
from pagedllm.bench.output import ratio
from pagedllm.entrypoints.cli import main
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


def test_bench_rows_and_ratios_come_from_the_runs(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lora"
    args = ["bench", "lora", "--model", str(tiny_llama_dir), "--out", str(out)]
    args += ["--workload", "fixed", "--num-prompts", "6", "--prompt-len", "8", "--output-len", "5"]
    args += ["--max-model-len", "64", "--kv-cache-tokens", "1024", "--seed", "1"]
    args += ["--num-adapters", "1,3", "--distributions", "zipf", "--paging-adapters", "3"]
    args += ["--peft-adapters", "3", "--lora-rank", "4", "--max-lora-rank", "4", "--max-loras", "1"]
    args += ["--rounds", "2"]
    assert main(args) == 0
    result = json.loads((out / "lora.json").read_text())
    assert result.keys() >= COMMON_KEYS
    rows = {r["system"]: r for r in result["results"]}
    assert list(rows) == [
        "base",
        "merged",
        "lora 1 zipf",
        "lora 3 zipf",
        "lora 3 uniform",
        "static 3 uniform",
        "peft",
    ]
    assert all(r["generated_tokens"] == 6 * 5 and r["requests"] == 6 for r in rows.values())
    for name, row in rows.items():  # the fastest of two rounds
        if name != "peft":
            assert row["generated_tokens_per_s"] == max(row["tok_s_rounds"])
            assert len(row["tok_s_rounds"]) == 2
    base, merged = rows["base"], rows["merged"]
    for name, row in rows.items():
        got = result["ratios"][name]
        for key, baseline in (("vs_base", base), ("vs_merged", merged)):
            want = ratio(row["generated_tokens_per_s"], baseline["generated_tokens_per_s"])
            assert row[f"generated_tokens_per_s_{key}"] == got[f"generated_tokens_per_s_{key}"]
            assert got[f"generated_tokens_per_s_{key}"] == want
    for n, dist in ((1, "zipf"), (3, "zipf"), (3, "uniform")):
        assert rows[f"lora {n} {dist}"]["adapters_used"] == len(set(assign_adapters(6, n, dist, 1)))
    # Unified paging in a pool with room for every adapter: each is loaded once, kept.
    for name in ("lora 1 zipf", "lora 3 zipf", "lora 3 uniform"):
        row = rows[name]
        assert (row["lora_loads"], row["lora_evictions"]) == (row["adapters_used"], 0)
        assert row["adapter_blocks_at_start"] == 0
    assert (base["lora_loads"], merged["lora_loads"]) == (0, 0)
    # One static slot for three adapters: they take turns in it, reloaded each time.
    static, unified = rows["static 3 uniform"], rows["lora 3 uniform"]
    assert static["adapter_blocks_at_start"] > 0
    assert static["adapters_used"] == unified["adapters_used"] > 1
    assert static["lora_loads"] > static["adapters_used"]
    assert static["lora_evictions"] == static["lora_loads"] - 1
    assert static["peak_running_seqs"] < unified["peak_running_seqs"]
    for key in ("requests_per_s", "mean_running_seqs", "lora_loads_per_s"):
        assert static[f"{key}_vs_unified"] == ratio(static[key], unified[key])
    assert rows["peft"]["adapters_used"] == unified["adapters_used"]
    want = ratio(unified["generated_tokens_per_s"], rows["peft"]["generated_tokens_per_s"])
    assert unified["generated_tokens_per_s_vs_peft"] == want
    assert any(n.startswith("peft: ") for n in result["notes"])
