"""`pagedllm bench`: the sweep benches' outputs (JSON keys, files written) on a tiny random
model, run once through `bench report --quick`; the bookkeeping run through the engine's own
step; the report page; the benches' pure helpers. The engine benches are in
test_engine_benches.py. No test asserts a timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_results import COMMON_KEYS
from pagedllm.bench.baselines import pack_static_batches, padded_utilization
from pagedllm.bench.output import distribution
from pagedllm.bench.report import KEPT, claims_rows, with_kept_sections
from pagedllm.bench.sweep import run_workload
from pagedllm.bench.sweep_benches import latency_stats
from pagedllm.bench.workload import BenchRequest, WorkloadSpec, make_workload
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.cli import main
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec

BENCHES = ("memory", "throughput", "latency", "block-size", "attention")


@pytest.fixture(scope="module")
def report(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    code = main(
        [
            "bench",
            "report",
            "--quick",
            "--model",
            str(tiny_llama_dir),
            "--out",
            str(out),
            "--docs",
            str(out / "benchmarks.md"),
        ]
    )
    assert code == 0
    return out


def _load(report: Path, bench: str) -> dict:
    return json.loads((report / bench / f"{bench}.json").read_text())


@pytest.mark.parametrize("bench", BENCHES)
def test_each_bench_writes_json_markdown_and_plots(report: Path, bench: str) -> None:
    result = _load(report, bench)
    assert result.keys() >= COMMON_KEYS
    assert result["bench"] == bench
    assert result["command"].startswith(f"pagedllm bench {bench} ")
    assert result["results"]
    for kind, path in result["files"].items():
        assert Path(path).is_file(), kind
    assert {"json", "md"} <= result["files"].keys()
    assert any(k.startswith("png_") for k in result["files"])
    md = (report / bench / f"{bench}.md").read_text()
    assert md.startswith(f"# pagedllm bench {bench}") and "|---|" in md


def test_throughput_rows_and_ratios(report: Path) -> None:
    result = _load(report, "throughput")
    rows = {r["system"]: r for r in result["results"]}
    assert {"paged", "reserve-max", "reserve-oracle", "hf"} <= rows.keys()
    for row in rows.values():
        assert {
            "requests_per_s",
            "generated_tokens_per_s",
            "mean_running_seqs",
            "peak_running_seqs",
            "kv_utilization",
            "preemptions",
        } <= row.keys()
        assert row["generated_tokens"] == 3 * 4
    assert rows["reserve-max"]["generated_tokens_per_s_vs_reserve-max"] == 1.0
    assert "generated_tokens_per_s_vs_hf" in rows["paged"]
    assert set(result["timelines"]) == {"paged", "reserve-max", "reserve-oracle"}
    if "llama-cpp" not in rows:
        assert any("llama-cpp" in n and "skipped" in n for n in result["notes"])


def test_memory_bench_reports_bookkeeping(report: Path) -> None:
    result = _load(report, "memory")
    assert "fake model runner" in result["runner"]
    rows = {r["system"]: r for r in result["results"]}
    bs = result["config"]["block_size"]
    assert rows["paged"]["max_empty_slots_per_seq"] < bs
    assert rows["reserve-max"]["kv_memory_vs_reserve_max"] == 1.0
    for r in rows.values():
        fracs = r["slots_tokens_frac"] + r["slots_reserved_frac"] + r["slots_wasted_frac"]
        assert fracs == pytest.approx(1.0, abs=1e-3)


def test_latency_block_size_and_attention_keys(report: Path) -> None:
    lat = _load(report, "latency")
    assert [r["system"] for r in lat["results"]] == ["paged", "reserve-max"]
    for r in lat["results"]:
        for m in ("ttft", "tpot", "norm_latency"):
            unit = "_ms" if m == "tpot" else "_s"
            assert {f"{m}_mean{unit}", f"{m}_median{unit}", f"{m}_p99{unit}"} <= r.keys()
    sweep = _load(report, "block-size")
    assert [r["block_size"] for r in sweep["results"]] == [8, 16]
    assert all(
        "attention_ms_per_step" in r and "internal_fragmentation" in r for r in sweep["results"]
    )
    att = _load(report, "attention")
    assert {r["phase"] for r in att["results"]} == {"decode", "prefill"}
    assert all(r["max_abs_diff"] < 1e-4 for r in att["results"])  # the same computation


def test_report_page(report: Path) -> None:
    page = (report / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks")
    assert "| claim | the vLLM paper says | measured here | our goal | verdict | command |" in page
    assert "the seed" not in page.lower() and "issue" not in page
    for bench in BENCHES:
        assert f"## {bench}" in page


def test_bad_arguments_exit_2(tiny_llama_dir: Path, tmp_path: Path) -> None:
    code = main(
        [
            "bench",
            "throughput",
            "--model",
            str(tiny_llama_dir),
            "--out",
            str(tmp_path),
            "--kv-cache-tokens",
            "64",
        ]
    )
    assert code == 2
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--policies", "reserve-some"])


def test_bookkeeping_run_is_the_engine_step() -> None:
    reqs = make_workload(WorkloadSpec("sharegpt", 40, seed=3), 100, 512)

    def run(policy: str) -> dict:
        config = EngineConfig(
            block_size=16,
            num_kv_blocks=80,
            max_model_len=512,
            enable_prefix_caching=False,
            kv_reservation=policy,
        )
        engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(100, 512)))
        return run_workload(engine, reqs, clock="steps").row

    paged, rmax = run("paged"), run("reserve-max")
    assert paged["generated_tokens"] == rmax["generated_tokens"] == sum(r.output_len for r in reqs)
    assert paged["max_empty_slots_per_seq"] < 16
    assert rmax["peak_running_seqs"] == 2  # 80 blocks hold two 512-token reservations
    assert paged["kv_utilization"] > rmax["kv_utilization"]


def test_bookkeeping_run_matches_the_model_run(tiny_llama_dir: Path) -> None:
    """Over FakeModelRunner the engine schedules exactly as over the model (EOS ignored,
    nothing cached): the same steps, admissions, preemptions and blocks."""
    from pagedllm.bench.options import get_loaded

    spec = WorkloadSpec("uniform", 8, prompt_range=(5, 40), output_range=(5, 40))
    reqs = make_workload(spec, 128, 128)
    config = EngineConfig(
        block_size=8, num_kv_blocks=20, max_model_len=128, enable_prefix_caching=False
    )
    fake_engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(128, 512)))
    fake = run_workload(fake_engine, reqs, clock="steps").row
    real = run_workload(LLMEngine(config, get_loaded(str(tiny_llama_dir))), reqs).row
    assert real["preemptions"] > 0  # the pool is small enough to exercise preemption
    for key in ("steps", "preemptions", "peak_used_blocks", "kv_utilization", "slots_wasted_frac"):
        assert fake[key] == real[key], key


def test_static_batches_fit_the_budget() -> None:
    reqs = [BenchRequest((1,) * p, o) for p, o in [(10, 5), (20, 30), (5, 5), (40, 60), (8, 2)]]
    batches = pack_static_batches(reqs, kv_tokens=120, max_batch=8)
    assert [r for b in batches for r in b] == reqs
    for b in batches:
        rect = len(b) * (max(r.prompt_len for r in b) + max(r.output_len for r in b))
        assert rect <= 120 or len(b) == 1
    assert padded_utilization([BenchRequest((1,) * 4, 2)]) == 1.0
    assert padded_utilization(reqs[:2]) < 1.0


def test_one_percentile_definition() -> None:
    figures = distribution([4.0, 1.0, 3.0, 2.0], "_s", "x_")
    assert figures == {"x_mean_s": 2.5, "x_median_s": 2.5, "x_p99_s": 3.97}  # interpolated
    assert distribution([], "_ms") == {"mean_ms": None, "median_ms": None, "p99_ms": None}


def test_latency_stats() -> None:
    per = {
        "0": {"arrival": 0.0, "first_token": 1.0, "finish": 2.0, "output_len": 11},
        "1": {"arrival": 1.0, "first_token": 1.5, "finish": 3.5, "output_len": 5},
    }
    s = latency_stats(per)
    assert s["ttft_mean_s"] == pytest.approx(0.75)
    assert s["tpot_mean_ms"] == pytest.approx((100 + 500) / 2)
    assert s["norm_latency_median_s"] == pytest.approx((2 / 11 + 0.5) / 2, abs=1e-3)


def test_claims_without_results() -> None:
    rows = claims_rows({})
    assert len(rows) >= 10
    assert all(r["verdict"] == "-" for r in rows)


def test_claims_read_each_figure_and_judge_each_goal() -> None:
    def row(system: str, **figures: float) -> dict[str, float | str]:
        return {"system": system, **figures}

    policies = [
        row("paged", kv_utilization=0.97, mean_running_seqs=8.0, generated_tokens_per_s=120.0),
        row("reserve-max", kv_utilization=0.1, mean_running_seqs=2.0, generated_tokens_per_s=40.0),
        row("reserve-oracle", kv_utilization=0.5, mean_running_seqs=4.0),
    ]
    results = {
        "throughput": {
            "command": "pagedllm bench throughput",
            "results": [*policies, row("hf", generated_tokens_per_s=30.0)],
        },
        "memory": {
            "results": [row("paged", max_empty_slots_per_seq=15, peak_used_blocks=264)],
            "config": {"block_size": 16, "kv_blocks": 264},
        },
        "attention": {"ratios": {"decode_median_overhead": 0.73}},
        "block-size": {
            "best_block_size": 16,
            "results": [{"block_size": 8, "generated_tokens_per_s": 9.0}],
        },
    }
    rows = {r["claim"]: r for r in claims_rows(results)}
    paged = rows["KV slots holding tokens, paged"]
    assert paged["measured"] == "97.0% (model run); - (bookkeeping)"
    assert (paged["verdict"], paged["command"]) == ("met", "`pagedllm bench throughput`")
    memory = rows["KV memory for the same tokens"]
    assert memory["measured"] == "89.7% less than reserve-max, 48.5% less than reserve-oracle"
    assert memory["verdict"] == "met"
    batch = rows["Batch size (mean concurrent sequences)"]
    assert batch["measured"].startswith("model run: 4.00x reserve-max, 2.00x reserve-oracle")
    assert rows["Throughput vs Hugging Face transformers"]["verdict"] == "missed"  # 4x < 5x
    assert rows["Internal fragmentation"]["verdict"] == "met"
    assert rows["External fragmentation"]["verdict"] == "met"
    block = rows["Block size"]["measured"]
    assert block == "best 16; tok/s by size: 8: 9.00"
    assert "decode 0.73x, prefill -" in rows["Cost of the block-table indirection"]["measured"]
    assert rows["Latency at the same load"]["verdict"] == "-"


def test_the_report_keeps_the_sections_measured_apart(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    assert with_kept_sections("# new\n", str(page)) == "# new\n"  # no page yet
    page.write_text("# old suite\n\ntable\n")
    assert with_kept_sections("# new\n", str(page)) == "# new\n"
    page.write_text(f"# old suite\n\n{KEPT}\n\n## scale-out\n\nits table\n")
    kept = with_kept_sections("# new\n", str(page))
    assert kept == f"# new\n\n{KEPT}\n\n## scale-out\n\nits table\n"


def test_step_cost_times_each_output_kind_and_prompt_length(tmp_path: Path) -> None:
    args = ["--streams", "4", "--prompt-lens", "20,300", "--steps", "3", "--out", str(tmp_path)]
    assert main(["bench", "step-cost", *args, "--output-kinds", "delta,final_only"]) == 0
    result = json.loads((tmp_path / "step-cost.json").read_text())
    assert result.keys() >= COMMON_KEYS
    rows = [(r["output_kind"], r["prompt_len"], r["streams"]) for r in result["results"]]
    assert rows == [
        ("delta", 20, 4),
        ("delta", 300, 4),
        ("final_only", 20, 4),
        ("final_only", 300, 4),
    ]
    assert [r["vs_shortest"] for r in result["results"]][::2] == [1.0, 1.0]
    assert result["ratios"].keys() == {
        "delta_longest_vs_shortest",
        "final_only_longest_vs_shortest",
    }
    assert result["config"]["penalties"] is False


def test_step_cost_with_penalties(tmp_path: Path) -> None:
    args = ["--streams", "4", "--prompt-lens", "20,300", "--steps", "3", "--out", str(tmp_path)]
    assert main(["bench", "step-cost", *args, "--output-kinds", "delta", "--penalties"]) == 0
    result = json.loads((tmp_path / "step-cost.json").read_text())
    assert result["config"]["penalties"] is True
    assert [r["prompt_len"] for r in result["results"]] == [20, 300]
