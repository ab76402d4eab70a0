"""`pagedllm bench`: every subcommand's outputs (JSON keys, files written) on a tiny random
model, run once through `bench report --quick`; the bookkeeping run through the engine's own
step; the serve bench against a live server; the benches' pure helpers.
No test asserts a timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from live_server import build_chat_model
from pagedllm.bench.baselines import pack_static_batches, padded_utilization
from pagedllm.bench.output import distribution
from pagedllm.bench.report import KEPT, claims_rows, with_kept_sections
from pagedllm.bench.sweep import run_workload
from pagedllm.bench.sweep_benches import latency_stats
from pagedllm.bench.workload import BenchRequest, WorkloadSpec, make_workload
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.cli import main
from pagedllm.kernels.cpu import missing_cpu_features
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec

BENCHES = ("memory", "throughput", "latency", "block-size", "attention")
COMMON_KEYS = {
    "bench",
    "command",
    "config",
    "environment",
    "results",
    "ratios",
    "notes",
    "files",
    "table_md",
}


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


def test_decode_bench_rows(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "decode"
    code = main(
        [
            "bench",
            "decode",
            "--model",
            str(tiny_llama_dir),
            "--out",
            str(out),
            "--batch-sizes",
            "1,3",
            "--steps",
            "2",
            "--prompt-len",
            "5",
        ]
    )
    assert code == 0
    result = json.loads((out / "decode.json").read_text())
    assert result.keys() >= COMMON_KEYS
    assert [r["batch"] for r in result["results"]] == [1, 3]
    assert all(r["pagedllm_ms"] > 0 and r["hf_ms"] > 0 for r in result["results"])
    assert all(0 < r["attention_share"] < 1 for r in result["results"])


@pytest.mark.skipif(bool(missing_cpu_features()), reason="no compiled kernels on this CPU")
def test_decode_bench_names_the_int8_kernels(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "decode"
    args = ["--model", str(tiny_llama_dir), "--out", str(out), "--no-hf", "--steps", "1"]
    args += ["--batch-sizes", "1,9", "--prompt-len", "4", "--quantization", "int8"]
    assert main(["bench", "decode", *args]) == 0
    config = json.loads((out / "decode.json").read_text())["config"]
    assert config["int8_isa"] in ("AVX2", "AVX-512 VNNI")
    assert set(config["int8_kernels"]) >= {"qkv", "gate_up", "down", "lm_head"}
    for kernels in config["int8_kernels"].values():
        assert kernels.startswith("gemv ") and ("gemm avx2" in kernels or "_int_mm" in kernels)


def test_quality_bench_compares_an_option_with_the_exact_default(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build_chat_model(tmp_path_factory)
    text = tmp_path / "text.txt"
    text.write_text("The river runs down to the sea, and the boats come home at dusk. " * 8)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is a river?\nName a color.\n")
    out = tmp_path / "quality"
    args = ["bench", "quality", "--model", str(model), "--out", str(out), "--tokens", "4"]
    args += ["--text", str(text), "--prompts", str(prompts), "--kv-cache-dtype", "float16"]
    assert main(args) == 0
    base, half = json.loads((out / "quality.json").read_text())["results"]
    assert (base["max_logit_diff"], base["greedy_agreement"]) == (0.0, "2/2")
    assert half["system"] == "kv_cache_dtype=float16"
    assert half["kv_bytes_per_token"] * 2 == base["kv_bytes_per_token"]
    assert 0 < half["max_logit_diff"] < 0.1 and half["perplexity"] > 1


def test_sharing_bench_counts_blocks_saved(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sharing"
    code = main(
        [
            "bench",
            "sharing",
            "--model",
            str(tiny_llama_dir),
            "--out",
            str(out),
            "--num-prompts",
            "1",
            "--prompt-len",
            "20",
            "--max-tokens",
            "4",
            "--widths",
            "2",
            "--block-size",
            "4",
        ]
    )
    assert code == 0
    rows = json.loads((out / "sharing.json").read_text())["results"]
    assert [(r["system"], r["width"]) for r in rows] == [
        ("parallel sampling", 2),
        ("beam search", 2),
    ]
    for r in rows:
        # Two sequences over a 20-token prompt (5 blocks): sharing always saves blocks.
        assert r["peak_blocks_in_use"] < r["peak_blocks_unshared"]
        assert 0 < r["mean_saved_frac"] < 1
    assert (out / "sharing_saved.png").exists()


def test_serve_bench_against_a_live_server(tmp_path: Path, capsys) -> None:
    """`bench serve` drives a real server (over the fake runner: no model to wait for)."""
    from live_server import LiveServer
    from pagedllm.entrypoints.server.app import create_app

    config = EngineConfig(num_kv_blocks=64, block_size=16, max_model_len=256)
    engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(32000, 512)))
    server = LiveServer(create_app(engine, served_model_name="fake"))
    try:
        out = tmp_path / "serve"
        argv = ["bench", "serve", "--url", server.url, "--out", str(out)]
        argv += ["--num-prompts", "6", "--prompt-len", "12", "--output-len", "5"]
        assert main([*argv, "--request-rate", "inf"]) == 0
        printed = capsys.readouterr().out
        assert "completed:" in printed and "| ITL |" in printed
        result = json.loads((out / "serve.json").read_text())
        assert result["summary"]["completed"] == 6 and result["summary"]["failed"] == 0
        assert result["summary"]["total_input_tokens"] == 6 * 12
        assert result["summary"]["total_output_tokens"] == 6 * 5
        assert [r["metric"] for r in result["results"]] == ["TTFT", "TPOT", "ITL", "E2EL"]
        assert (out / "serve.md").is_file() and (out / "serve_latency_cdf.png").is_file()
        assert main([*argv, "--max-concurrency", "2"]) == 0
        # The identical load against a second server (here the same one): both, and ratios.
        assert main([*argv, "--max-concurrency", "3", "--compare-url", server.url]) == 0
        result = json.loads((out / "serve.json").read_text())
        assert result["compared"]["summary"]["completed"] == 6
        rows = {r["metric"]: r for r in result["results"]}
        assert rows["output tok/s"]["ours"] > 0 and rows["output tok/s"]["ratio"] > 0
        assert {"TTFT mean ms", "TPOT p99 ms", "ITL median ms"} <= rows.keys()
        # Word prompts need the server's tokenizer, which this one lacks: every request fails.
        assert main([*argv, "--max-concurrency", "2", "--prompt-kind", "words"]) == 1
        assert main([*argv]) == 2  # neither a request rate nor a concurrency cap
    finally:
        server.close()


def test_list_options_and_sweeps(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    base = ["bench", "block-size", "--model", str(tiny_llama_dir), "--out", str(tmp_path)]
    assert main([*base, "--block-sizes", "8,512"]) == 2
    assert "block_size must be in [1, 256], got 512" in capsys.readouterr().err
    assert main([*base, "--block-sizes", "8", "--block-size", "16"]) == 2
    assert "give --block-sizes or --block-size, not both" in capsys.readouterr().err


def test_structured_bench_times_masks_and_compiles(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build_chat_model(tmp_path_factory)  # SmolLM2's tokenizer: real grammars
    out = tmp_path / "structured"
    args = ["bench", "structured", "--model", str(model), "--out", str(out)]
    args += ["--batch-sizes", "1,3", "--steps", "2", "--prompt-len", "4", "--rounds", "1"]
    assert main(args) == 0
    result = json.loads((out / "structured.json").read_text())
    assert result.keys() >= COMMON_KEYS
    assert [r["batch"] for r in result["results"]] == [1, 3]
    for row in result["results"]:
        assert row["plain_ms"] > 0 and row["structured_ms"] > 0
        assert row["ratio"] == pytest.approx(row["structured_ms"] / row["plain_ms"], rel=0.05)
    summary = result["summary"]
    assert summary["compile json schema, cold (ms)"] > 0
    assert len(summary) == 2 * 6
    assert "the KV pool was not whole" not in " ".join(result["notes"])
    assert "ratio" in (out / "structured.md").read_text()


def test_sweep_rows_report_speculation() -> None:
    config = EngineConfig(
        block_size=4,
        num_kv_blocks=64,
        speculative_method="ngram",
        num_speculative_tokens=3,
        prompt_lookup_min=1,
    )
    engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(100, 4096), token=5))
    requests = [BenchRequest((5, 6, 5, 6), 20), BenchRequest((1, 2, 3), 10)]
    row = run_workload(engine, requests, clock="steps").row
    snap = engine.snapshot()
    assert row["generated_tokens"] == 30 and row["steps"] < 30
    assert row["spec_acceptance_rate"] == round(snap.spec_acceptance_rate, 4) > 0
    assert row["spec_mean_accepted_length"] == round(snap.spec_mean_accepted_length, 3) > 1


def test_spec_bench_compares_tpot_with_and_without_ngram(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = build_chat_model(tmp_path_factory)  # a chat template: the copy prompts
    out = tmp_path / "spec"
    args = ["bench", "spec", "--model", str(model), "--out", str(out)]
    assert main([*args, "--num-prompts", "1", "--max-tokens", "12"]) == 0
    result = json.loads((out / "spec.json").read_text())
    assert result.keys() >= COMMON_KEYS
    off, ngram = result["results"]
    assert off["mode"] == "off" and ngram["mode"] == "ngram k=4 lookup 2..4"
    assert off["same_tokens"] and ngram["same_tokens"]  # greedy: the same tokens
    assert off["acceptance_rate"] is None and 0 <= ngram["acceptance_rate"] <= 1
    assert off["tpot_ms"] > 0 and ngram["tpot_ms"] > 0
    assert result["summary"]["same_tokens"] is True


def test_the_report_keeps_the_sections_measured_apart(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    assert with_kept_sections("# new\n", str(page)) == "# new\n"  # no page yet
    page.write_text("# old suite\n\ntable\n")
    assert with_kept_sections("# new\n", str(page)) == "# new\n"
    page.write_text(f"# old suite\n\n{KEPT}\n\n## scale-out\n\nits table\n")
    kept = with_kept_sections("# new\n", str(page))
    assert kept == f"# new\n\n{KEPT}\n\n## scale-out\n\nits table\n"
