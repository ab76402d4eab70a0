"""`pagedllm bench` subcommands that time the engine itself, on a tiny random model: decode
(and its int8 kernel names), quality, sharing, structured output, speculative decoding; the
serve bench against a live server; the sweep rows' speculation figures; the options list.
No test asserts a timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_results import COMMON_KEYS
from live_server import build_chat_model
from pagedllm.bench.memory_floor import weight_bytes_per_step
from pagedllm.bench.sweep import run_workload
from pagedllm.bench.workload import BenchRequest
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.cli import main
from pagedllm.kernels.cpu import missing_cpu_features
from pagedllm.model.config import ModelConfig
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec


def assert_rounded_ratio(
    ratio: float, ratio_step: float, num: float, num_step: float, den: float, den_step: float
) -> None:
    """`ratio` is num / den computed before each was rounded to its step: it lies within
    what the roundings allow, however small the figures (a tiny model's step is well
    under a millisecond, so a fixed relative tolerance does not hold)."""
    low = (num - num_step / 2) / (den + den_step / 2) - ratio_step / 2
    high = (num + num_step / 2) / (den - den_step / 2) + ratio_step / 2
    assert low - 1e-9 <= ratio <= high + 1e-9, (ratio, num, den)


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
    for r in result["results"]:  # two timed steps: their mean is their median
        assert r["pagedllm_mean_ms"] == pytest.approx(r["pagedllm_ms"], abs=0.051)
    assert all(0 < r["attention_share"] < 1 for r in result["results"])
    config = result["config"]
    assert config["read_gb_per_s"] > 0 and config["weights_floor_ms"] > 0
    floor = config["weights_floor_ms"]  # 4 significant digits
    for r in result["results"]:
        assert_rounded_ratio(r["of_floor"], 0.01, r["pagedllm_ms"], 0.1, floor, floor * 1e-3)


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
        assert "gemv " in kernels and ("gemm avx2" in kernels or "_int_mm" in kernels)
        # Without VNNI the AVX2 GEMM's panels also take the fewest rows.
        assert kernels.startswith("gemm avx2 panels") == (
            config["int8_isa"] == "AVX2" and "gemm avx2 above" in kernels
        )


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
        assert result["summary"]["client_cpu_ms_per_token"] > 0
        assert [r["metric"] for r in result["results"]] == ["TTFT", "TPOT", "ITL", "E2EL"]
        assert (out / "serve.md").is_file() and (out / "serve_latency_cdf.png").is_file()
        assert main([*argv, "--max-concurrency", "2"]) == 0
        # The identical load against a second server (here the same one): both, and ratios.
        assert main([*argv, "--max-concurrency", "3", "--compare-url", server.url]) == 0
        result = json.loads((out / "serve.json").read_text())
        assert result["compared"]["summary"]["completed"] == 6
        assert result["compared"]["summary"]["client_cpu_ms_per_token"] > 0
        rows = {r["metric"]: r for r in result["results"]}
        assert rows["output tok/s"]["ours"] > 0 and rows["output tok/s"]["ratio"] > 0
        assert {"TTFT mean ms", "TPOT p99 ms", "ITL median ms"} <= rows.keys()
        # In three parts that alternate between the servers: every request on each, once.
        assert (
            main([*argv, "--max-concurrency", "3", "--compare-url", server.url, "--rounds", "3"])
            == 0
        )
        result = json.loads((out / "serve.json").read_text())
        assert result["config"]["rounds"] == 3
        for summary in (result["summary"], result["compared"]["summary"]):
            assert (summary["completed"], summary["total_output_tokens"]) == (6, 6 * 5)
        assert main([*argv, "--max-concurrency", "3", "--rounds", "2"]) == 2  # no second server
        assert "give --compare-url" in capsys.readouterr().err
        assert (
            main([*argv, "--max-concurrency", "3", "--compare-url", server.url, "--rounds", "7"])
            == 2
        )
        assert (
            "rounds must be between 1 and the number of requests (6), got 7"
            in capsys.readouterr().err
        )
        # Word prompts need the server's tokenizer, which this one lacks: every request fails.
        assert main([*argv, "--max-concurrency", "2", "--prompt-kind", "words"]) == 1
        assert main([*argv]) == 2  # neither a request rate nor a concurrency cap
    finally:
        server.close()


def test_list_options_and_sweeps(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    base = ["bench", "block-size", "--model", str(tiny_llama_dir), "--out", str(tmp_path)]
    assert main([*base, "--block-sizes", "8,512"]) == 2
    assert "block_size must be an integer in [1, 256], got 512" in capsys.readouterr().err
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
        assert_rounded_ratio(row["ratio"], 1e-3, row["structured_ms"], 0.01, row["plain_ms"], 0.01)
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


def test_the_weights_a_decode_step_reads_are_counted_exactly() -> None:
    """SmolLM2-135M's shapes: 134,479,872 weights in its linear layers (the output layer is
    the tied embedding), 35,136 in its norms."""
    config = ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
    )
    norms = 4 * 35_136
    assert weight_bytes_per_step(config, None, "float32") == 4 * 134_479_872 + norms
    assert weight_bytes_per_step(config, None, "bfloat16") == 2 * 134_479_872 + norms
    # int8: a byte a weight, and each layer's fp32 output scales and input smoothing
    scales = 4 * (30 * (1152 + 768 + 768 + 1152 + 3 * 2112) + 49152 + 576)
    assert weight_bytes_per_step(config, "int8", "float32") == 134_479_872 + scales + norms
