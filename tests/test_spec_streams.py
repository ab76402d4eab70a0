"""`pagedllm bench spec-streams`: n-gram speculation at several streams on the shipped
texts, end to end on a tiny random model with SmolLM2's tokenizer (its report's fields,
the tokens equal with and without speculation); the closed loop of streams over the fake
runner, where proposals are made and kept; how the sweep picks the batch size from which
speculating costs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_results import COMMON_KEYS
from live_server import build_chat_model
from pagedllm.bench.spec_streams import (
    COPY_INSTRUCTIONS,
    disable_threshold,
    paragraphs,
    questions,
    run_row,
    run_streams,
    spec_options,
    sweep_advice,
    workload_messages,
)
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec


def test_workloads_cycle_the_shipped_texts() -> None:
    paras, asked = paragraphs(), questions()
    copy = workload_messages("copy", len(paras) + 2)
    assert copy[0] == f"{COPY_INSTRUCTIONS[0]}\n\n{paras[0]}"
    assert copy[1] == f"{COPY_INSTRUCTIONS[1]}\n\n{paras[1]}"
    assert copy[len(paras)].endswith(paras[0])  # the paragraphs cycle
    chat = workload_messages("chat", len(asked) + 1)
    assert chat[: len(asked)] == asked and chat[-1] == asked[0]
    assert all(len(p) <= 600 for p in paras) and len(asked) >= 30


def fake_engine(**spec: object) -> LLMEngine:
    """An engine over the fake runner, whose model always says 5: proposals drawn from
    sequences of 5s are what it would say, so speculating keeps the same tokens."""
    config = EngineConfig(block_size=4, num_kv_blocks=128, **spec)  # type: ignore[arg-type]
    return LLMEngine(config, runner=FakeModelRunner(ModelSpec(100, 4096), token=5))


def test_streams_stay_in_flight_until_the_prompts_run_out() -> None:
    prompts = [[5, 5, 5, 5], [5, 5, 5], [5, 5], [5, 5, 5], [5, 5, 5, 5, 5]]
    base = run_streams(fake_engine(), prompts, streams=2, max_tokens=6)
    engine = fake_engine(speculative_method="ngram", num_speculative_tokens=3)
    run = run_streams(engine, prompts, streams=2, max_tokens=6)
    assert run.tokens == base.tokens == [[5] * 6] * 5 and run.generated == 30
    assert engine.snapshot().spec_accepted_tokens > 0 and run.steps < base.steps
    # Two in flight until the last prompt runs alone: never more than two.
    assert 1 < run.running_sum / run.steps <= 2
    assert 0 < run.full_batch_tokens < 30 and run.full_batch_seconds <= run.seconds
    row = run_row("copy", 2, "ngram", run, base)
    assert (row["requests"], row["generated_tokens"], row["steps"]) == (5, 30, run.steps)
    assert row["same_tokens"] is True and row["differing_requests"] == 0
    assert engine.kv.usage().used_blocks == 0  # the pool whole at the end


def test_the_threshold_is_where_speculation_stays_slower() -> None:
    def rows(*ratios: float | None) -> list[dict]:
        return [{"streams": 2**i, "full_batch_ratio": r} for i, r in enumerate(ratios)]

    assert disable_threshold(rows(1.5, 1.2, 0.9, 0.8)) == 4
    assert disable_threshold(rows(1.5, 0.9, 1.1, 0.8)) == 8  # slower again only from 8
    assert disable_threshold(rows(1.5, 1.2, 1.0)) is None
    assert disable_threshold(rows(0.9, 0.8)) == 1
    assert disable_threshold(rows(1.2, None, 0.9)) == 4  # a size without a full batch
    assert "batch-size 4" in sweep_advice(4) and "none" in sweep_advice(None)


def test_speculation_options_reach_only_the_ngram_engine() -> None:
    args = build_parser().parse_args(["bench", "spec-streams"])
    off, spec = spec_options(args)
    assert off["speculative_method"] is None and off["num_speculative_tokens"] is None
    assert spec == {
        "speculative_method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
        # No limit: above any batch (the engine's default limit is what the sweep measures).
        "speculative_disable_by_batch_size": off["max_num_seqs"] + 1,
    }
    flags = ["--num-speculative-tokens", "2", "--speculative-disable-by-batch-size", "16"]
    off, spec = spec_options(build_parser().parse_args(["bench", "spec-streams", *flags]))
    assert off["speculative_disable_by_batch_size"] is None
    assert (spec["num_speculative_tokens"], spec["speculative_disable_by_batch_size"]) == (2, 16)
    with pytest.raises(SystemExit):  # an unknown workload is a usage error
        build_parser().parse_args(["bench", "spec-streams", "--workloads", "copy,poems"])


def test_bench_runs_both_workloads_at_several_streams(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build_chat_model(tmp_path_factory)  # a chat template for the prompts
    out = tmp_path / "streams"
    args = ["bench", "spec-streams", "--model", str(model), "--out", str(out)]
    args += ["--streams", "1,2", "--max-tokens", "5", "--num-kv-blocks", "256"]
    args += ["--requests-per-stream", "1"]  # the fake runner's test covers a closed loop
    assert main(args) == 0
    result = json.loads((out / "spec-streams.json").read_text())
    assert result.keys() >= COMMON_KEYS
    rows = result["results"]
    label = "ngram k=4 lookup 2..4"
    expected = [(w, s, m) for w in ("copy", "chat") for s in (1, 2) for m in ("off", label)]
    assert [(r["workload"], r["streams"], r["mode"]) for r in rows] == expected
    for row in rows:
        assert row["requests"] == row["streams"]
        assert 0 < row["generated_tokens"] <= 5 * row["requests"]
        assert row["tokens_per_s"] > 0 and row["full_batch_tokens_per_s"] > 0
        assert 0 < row["mean_running"] <= row["streams"]
        assert row["same_tokens"] is True and row["differing_requests"] == 0
        if row["mode"] == "off":
            assert "acceptance_rate" not in row and "ratio" not in row
        else:
            # A random model's output seldom repeats: it may propose nothing (length 0).
            assert 0 <= row["acceptance_rate"] <= 1
            assert row["mean_accepted_length"] == 0 or row["mean_accepted_length"] >= 1
            assert row["ratio"] > 0 and row["full_batch_ratio"] > 0
    summary = result["summary"]
    assert summary["same_tokens"] is True
    assert {"copy_acceptance_rate", "chat_slower_from_streams"} <= summary.keys()
    assert result["config"]["streams"] == [1, 2] and result["config"]["eos"] == "honoured"
    assert "same tokens as off" in (out / "spec-streams.md").read_text()


def test_sweep_runs_the_chat_workload_and_advises(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build_chat_model(tmp_path_factory)
    out = tmp_path / "sweep"
    args = ["bench", "spec-streams", "--sweep", "--model", str(model), "--out", str(out)]
    args += ["--streams", "1,2", "--max-tokens", "3", "--requests-per-stream", "1"]
    assert main([*args, "--num-kv-blocks", "128"]) == 0
    result = json.loads((out / "spec-streams.json").read_text())
    assert {r["workload"] for r in result["results"]} == {"chat"}
    assert [r["streams"] for r in result["results"]] == [1, 1, 2, 2]
    found = result["summary"]["chat_slower_from_streams"]
    assert found in (None, 1, 2)
    assert sweep_advice(found) in result["notes"]
