"""`pagedllm bench llamacpp` without llama.cpp: the random-weight GGUF writer (shapes as asked,
both architectures, streamed), pagedllm's measurement process on a tiny file, and the bench
over stand-ins for llama.cpp's tools (whose memory must not be counted as pagedllm's) or
without them. No test asserts a timing."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedllm.bench import llamacpp
from pagedllm.bench.gguf_probe import PROMPT_REPETITIONS, probe_pagedllm
from pagedllm.bench.random_gguf import ModelShape, write_random_gguf
from pagedllm.entrypoints.cli import main
from pagedllm.errors import KernelUnavailableError
from pagedllm.kernels.cpu import load_cpu_ops
from pagedllm.loader import ModelLoadError, default_model_path, load_model
from pagedllm.model.gguf_linear import GGUFWeight

SMOLLM2_VOCAB = 49152
TINY_LLAMA = ModelShape("tiny-llama", "llama", 64, 128, 2, 4, 2, SMOLLM2_VOCAB, 130000.0)
TINY_QWEN2 = ModelShape(
    "tiny-qwen2", "qwen2", 64, 96, 2, 4, 1, SMOLLM2_VOCAB + 40, 1e6, 1e-6, 4096,
    qkv_bias=True, tied_embeddings=False,
)  # fmt: skip
FAKE_LLAMA_BENCH_BYTES = 600 << 20  # far above what pagedllm takes on the tiny model


@pytest.fixture(scope="module")
def tokenizer_source() -> str:
    try:
        return default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def built_kernels() -> None:
    """The compiled CPU kernels built in this process, before a probe measures its peak
    memory: on a cold cache the probe would build them itself, and wait4's peak counts
    the compiler it waits for (g++ on torch's headers: ~610 MB, against the probe's own
    ~320 MB on the tiny model), which is not pagedllm's memory."""
    with contextlib.suppress(KernelUnavailableError):  # the probe then says why itself
        load_cpu_ops()


@pytest.mark.parametrize("shape", [TINY_LLAMA, TINY_QWEN2], ids=lambda s: s.arch)
def test_written_gguf_loads_with_the_shape_asked(
    shape: ModelShape, tokenizer_source: str, tmp_path: Path
) -> None:
    path = tmp_path / "model.gguf"
    write_random_gguf(str(path), shape, 0, tokenizer_source)
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == shape.arch
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.1.ffn_down.weight"] == "F16" and kinds["blk.0.attn_norm.weight"] == "F32"
    loaded = load_model(str(path), keep_quantized=True)
    c = loaded.config
    dims = (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads)
    assert dims == (shape.hidden, shape.ffn, shape.layers, shape.heads)
    assert (c.num_key_value_heads, c.vocab_size, c.rope_theta) == (
        shape.kv_heads,
        shape.vocab,
        shape.rope_base,
    )
    assert c.tie_word_embeddings == shape.tied_embeddings
    assert c.attention_bias == shape.qkv_bias
    assert ("lm_head.weight" in loaded.weights) == (not shape.tied_embeddings)
    q = loaded.weights["model.layers.1.self_attn.q_proj.weight"]
    assert isinstance(q, GGUFWeight) and q.shape == (shape.hidden, shape.hidden)
    k = loaded.weights["model.layers.1.self_attn.k_proj.weight"]
    assert k.shape == (shape.kv_heads * shape.head_dim, shape.hidden)
    if shape.qkv_bias:
        bias = loaded.weights["model.layers.0.self_attn.v_proj.bias"]
        assert bias.shape == (shape.kv_heads * shape.head_dim,) and 0.01 < bias.std() < 0.03
    # SmolLM2's tokenizer, padded with unused tokens up to the vocabulary
    assert len(loaded.tokenizer) == shape.vocab
    text = "What is the capital of France?"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == text
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == shape.vocab
    if shape.vocab > SMOLLM2_VOCAB:
        assert tokens[-1] == f"<|unused_{shape.vocab - SMOLLM2_VOCAB - 1}|>"


def test_writer_never_holds_the_model(tokenizer_source: str, tmp_path: Path) -> None:
    """An 80 MB model written while numpy and Python allocate at most a small share of it:
    the matrices are drawn and written a chunk at a time."""
    shape = ModelShape("medium", "llama", 512, 2048, 4, 8, 8, SMOLLM2_VOCAB, 1e4)
    write_random_gguf(str(tmp_path / "warm.gguf"), TINY_LLAMA, 0, tokenizer_source)  # caches
    tracemalloc.start()
    try:
        write_random_gguf(str(tmp_path / "medium.gguf"), shape, 1, tokenizer_source)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = os.path.getsize(tmp_path / "medium.gguf")
    assert size > shape.f16_bytes() > 80e6
    assert peak < size / 4, (peak, size)
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "medium.gguf")).tensors}
    values = tensors["blk.3.ffn_up.weight"].data.astype(np.float32)
    assert values.shape == (shape.ffn, shape.hidden)
    assert 0.019 < float(values.std()) < 0.021 and abs(float(values.mean())) < 1e-3


def tiny_weight_bytes(shape: ModelShape) -> int:
    """The bytes a decode step reads of the tiny F16 model: every matrix but the embedding
    lookup (tied: the embedding is also the output layer) at 2 bytes, the norms in fp32."""
    kv = shape.kv_heads * shape.head_dim
    layer = 2 * (shape.hidden * (2 * shape.hidden + 2 * kv) + 3 * shape.hidden * shape.ffn)
    layer += 4 * 2 * shape.hidden
    return shape.layers * layer + 2 * shape.vocab * shape.hidden + 4 * shape.hidden


def test_pagedllm_probe_figures(tokenizer_source: str, built_kernels: None, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_random_gguf(str(path), TINY_LLAMA, 0, tokenizer_source)
    got = probe_pagedllm(str(path), steps=4, threads=1, kv_cache_memory="8MiB", prompt_tokens=40)
    assert "error" not in got and "prompt_error" not in got, got
    assert 0 < got["engine_s"] <= got["ready_s"] <= got["process_ready_s"]
    assert got["ms_per_token"] > 0 and got["threads"] == 1
    assert 0.5 * 2**23 < got["kv_pool_bytes"] <= 2**23
    assert got["weight_bytes_per_step"] == tiny_weight_bytes(TINY_LLAMA)
    assert 50e6 < got["peak_rss_bytes"] < FAKE_LLAMA_BENCH_BYTES
    assert got["gguf_kernel"] in ("avx2", "vnni")
    # the prompt: the median of its repetitions (one engine step each), as tokens per second
    assert got["prompt_tokens"] == 40
    assert len(got["prompt_repetitions_ms"]) == PROMPT_REPETITIONS
    median = sorted(got["prompt_repetitions_ms"])[PROMPT_REPETITIONS // 2]
    assert got["prompt_ms"] == pytest.approx(median, abs=0.01)
    # prompt_ms is rounded to 0.001, which on a tiny model is more than 0.1% of it
    assert got["prompt_ms"] == pytest.approx(40_000 / got["prompt_tok_s"], abs=6e-4)


def test_probe_says_when_the_prompt_does_not_fit(tmp_path: Path) -> None:
    """A prompt longer than the model's context: the decode figures, and why no prompt's."""
    shape = ModelShape("small", "llama", 64, 128, 2, 4, 2, 256, 1e4)
    path = tmp_path / "small.gguf"
    write_vocabless_gguf(path, shape)  # a context of 256 tokens
    got = probe_pagedllm(str(path), steps=2, threads=1, kv_cache_memory="8MiB", prompt_tokens=300)
    assert got["ms_per_token"] > 0 and "prompt_ms" not in got
    assert got["prompt_error"].startswith("a 300-token prompt: ")


def test_prompt_figures_over_rounds() -> None:
    """Each system's prompt figures are those of its round of median prompt time, apart
    from its decode round; the prompt's ratio is of tokens per second (higher: pagedllm
    faster), the median of the rounds' ratios."""
    ours = [
        {"ms_per_token": ms, "peak_rss_bytes": 1, "prompt_ms": p, "prompt_tok_s": 512_000 / p}
        | {"prompt_tokens": 512, "prompt_repetitions_ms": [p]}
        for ms, p in [(10.0, 400.0), (12.0, 100.0), (11.0, 200.0)]
    ]
    theirs = [dict(r, prompt_tok_s=1000.0) for r in ours]
    median = llamacpp.median_round(ours)
    assert median["ms_per_token"] == 11.0 and median["prompt_ms"] == 200.0
    assert median["prompt_repetitions_ms"] == [200.0]
    ratios = llamacpp.round_ratios(ours, theirs)
    assert ratios["prompt_round_ratios"] == [1.28, 5.12, 2.56]
    assert ratios["prompt_ratio"] == 2.56 and ratios["round_ratios"] == [1.0, 1.0, 1.0]
    refused = [*ours[:2], {"ms_per_token": 9.0, "peak_rss_bytes": 1, "prompt_error": "why"}]
    median = llamacpp.median_round(refused)
    assert median["prompt_error"] == "why" and "prompt_ms" not in median


def write_fake_tools(folder: Path) -> None:
    """Stand-ins for llama.cpp: llama-quantize copies its input; llama-bench touches
    FAKE_LLAMA_BENCH_BYTES and prints its tests as llama-bench's JSON does: a pp test for a
    prompt (-p) of more than 0 tokens (2 ms/token), then a tg test (40 ms/token)."""
    folder.mkdir()
    scripts = {
        "llama-quantize": "import shutil, sys\nshutil.copyfile(sys.argv[1], sys.argv[2])\n",
        "llama-bench": (
            "import json, sys\n"
            f"held = b'x' * {FAKE_LLAMA_BENCH_BYTES}\n"
            "n = int(sys.argv[sys.argv.index('-n') + 1])\n"
            "p = int(sys.argv[sys.argv.index('-p') + 1])\n"
            "pp = [{'build_commit': 'fake', 'build_number': 1, 'n_prompt': p, 'n_gen': 0,"
            " 'avg_ns': p * 2_000_000, 'avg_ts': 500.0,"
            " 'samples_ns': [p * 1_000_000, p * 3_000_000]}]\n"
            "tg = [{'build_commit': 'fake', 'build_number': 1, 'n_prompt': 0,"
            " 'n_gen': n, 'avg_ns': n * 40_000_000, 'avg_ts': 25.0,"
            " 'samples_ns': [n * 30_000_000, n * 50_000_000]}]\n"
            "print(json.dumps((pp if p else []) + tg))\n"
        ),
    }
    for name, body in scripts.items():
        (folder / name).write_text(f"#!{sys.executable}\n{body}")
        (folder / name).chmod(0o755)


def test_bench_over_llama_cpp_tools(
    tokenizer_source: str, built_kernels: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = ModelShape("smollm2-1.7b", "llama", 64, 128, 2, 4, 2, SMOLLM2_VOCAB, 130000.0)
    monkeypatch.setitem(llamacpp.SHAPES, "smollm2-1.7b", tiny)
    write_fake_tools(tmp_path / "bin")
    work, out = tmp_path / "work", tmp_path / "out"
    argv = ["bench", "llamacpp", "--models", "smollm2-1.7b", "--llama-cpp-bin"]
    argv += [str(tmp_path / "bin"), "--work", str(work), "--out", str(out), "--steps", "3"]
    argv += ["--prompt-tokens", "48", "--kv-cache-memory", "8MiB"]
    assert main([*argv, "--tokenizer-from", tokenizer_source]) == 0
    result = json.loads((out / "llamacpp.json").read_text())
    (row,) = result["results"]
    stem = tiny.file_stem(0)
    assert os.listdir(work) == [f"{stem}.Q4_K_M.gguf"]  # the F16 is gone once quantized
    assert row["file"] == str(work / f"{stem}.Q4_K_M.gguf")
    assert row["llama_cpp_ms"] == 40.0 and row["llama_cpp_repetitions_ms"] == [30.0, 50.0]
    assert row["pagedllm_ms"] > 0
    assert len(row["round_ratios"]) == 3  # --rounds' default: llama.cpp, pagedllm, thrice
    assert row["ms_ratio"] == pytest.approx(row["pagedllm_ms"] / 40.0, abs=0.006)
    # each process's own peak: the stand-in's 600 MiB are not pagedllm's
    assert row["llama_cpp_rss_gb"] * 1e9 > FAKE_LLAMA_BENCH_BYTES
    assert 0 < row["pagedllm_rss_gb"] * 1e9 < FAKE_LLAMA_BENCH_BYTES
    less_kv = row["pagedllm_rss_gb"] - row["kv_pool_gb"]
    assert row["pagedllm_rss_less_kv_gb"] == pytest.approx(less_kv, abs=2e-3)
    bound = row["file_gb"] + row["kv_pool_gb"] + 0.5
    assert row["bound_gb"] == pytest.approx(bound, abs=2e-3)
    assert row["within_bound"] == ("yes" if row["pagedllm_rss_gb"] <= row["bound_gb"] else "no")
    assert result["config"]["llama_cpp_build"] == "fake (build 1)"
    # the prompt: llama-bench's pp48 from the same call, pagedllm's one-step prefill
    assert result["config"]["prompt_tokens"] == 48
    assert row["llama_cpp_prompt_tok_s"] == 500.0 and row["llama_cpp_prompt_ms"] == 96.0
    assert row["llama_cpp_prompt_repetitions_ms"] == [48.0, 144.0]
    assert row["pagedllm_prompt_tok_s"] > 0
    assert len(row["pagedllm_prompt_repetitions_ms"]) == PROMPT_REPETITIONS
    # the probe rounds ms to 0.001 and tok/s to 0.01, then the row ms to 0.01 and tok/s to
    # 0.1: both of ms's half steps, and tok/s's carried through 48,000 / tok/s (it grows
    # with the step's time: a busy machine's slow step)
    tok_s = row["pagedllm_prompt_tok_s"]
    assert row["pagedllm_prompt_ms"] == pytest.approx(
        48_000 / tok_s, abs=0.0056 + 48_000 * 0.056 / tok_s**2
    )
    assert len(row["prompt_round_ratios"]) == 3
    ratio = row["pagedllm_prompt_tok_s"] / 500.0  # higher: pagedllm processes faster
    assert row["prompt_ratio"] == pytest.approx(ratio, abs=0.006)
    assert result["ratios"]["smollm2-1.7b"]["prompt"] == row["prompt_ratio"]
    assert "| prompt: pagedllm / llama.cpp |" in result["table_md"]


def test_quant_names_the_file_and_the_type(tokenizer_source: str, tmp_path: Path) -> None:
    """--quant: the file is quantized to that type (llama-quantize's last argument; this
    stand-in writes it as the file) and named by it, and a second run reuses it."""
    tool = tmp_path / "llama-quantize"
    tool.write_text(f"#!{sys.executable}\nimport sys\nopen(sys.argv[2], 'w').write(sys.argv[3])\n")
    tool.chmod(0o755)
    tiny = ModelShape("smollm2-1.7b", "llama", 64, 128, 2, 4, 2, SMOLLM2_VOCAB, 130000.0)
    work = tmp_path / "work"
    args = argparse.Namespace(
        work=str(work), seed=0, quant="Q4_0", keep_f16=False, tokenizer_from=tokenizer_source
    )
    path, note = llamacpp.quantized_model(tiny, args, str(tool))
    assert path == str(work / f"{tiny.file_stem(0)}.Q4_0.gguf")
    assert note.startswith(f"smollm2-1.7b: wrote {path}")
    assert Path(path).read_text() == "Q4_0" and os.listdir(work) == [Path(path).name]
    assert llamacpp.quantized_model(tiny, args, None) == (path, f"smollm2-1.7b: reused {path}")


def test_bench_without_llama_cpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No llama.cpp anywhere: the bench says so, skips a shaped model whose file it cannot
    make, and measures pagedllm alone on one whose file is already in --work."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv(llamacpp.BIN_ENV, raising=False)
    shapes = {
        name: ModelShape(name, "llama", 64, 128, 2, 4, 2, 256, 1e4) for name in llamacpp.SHAPES
    }
    for name, shape in shapes.items():
        monkeypatch.setitem(llamacpp.SHAPES, name, shape)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    cached = work / f"{shapes['smollm2-1.7b'].file_stem(0)}.Q4_K_M.gguf"
    write_vocabless_gguf(cached, shapes["smollm2-1.7b"])
    models = "smollm2-1.7b,qwen2.5-7b"
    argv = ["bench", "llamacpp", "--models", models, "--work", str(work), "--out", str(out)]
    argv += ["--prompt-tokens", "0"]  # no prompt timed: no prompt columns
    assert main([*argv, "--steps", "2", "--kv-cache-memory", "8MiB"]) == 0
    result = json.loads((out / "llamacpp.json").read_text())
    (row,) = result["results"]
    assert row["model"] == "smollm2-1.7b" and row["pagedllm_ms"] > 0
    assert "llama_cpp_ms" not in row and row["ms_ratio"] is None
    assert "pagedllm_prompt_tok_s" not in row and row["prompt_ratio"] is None
    assert "prompt tok/s" not in result["table_md"]
    assert "prompt" not in result["ratios"]["smollm2-1.7b"]
    notes = " ".join(result["notes"])
    assert "llama.cpp not found" in notes
    assert "qwen2.5-7b: skipped, writing its Q4_K_M file needs llama-quantize" in notes
    assert os.listdir(work) == [cached.name]


def write_vocabless_gguf(path: Path, shape: ModelShape) -> None:
    """`shape` (a Llama) of random F16 weights, with no tokenizer: pagedllm loads it."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        (writer.add_context_length, 256),
        (writer.add_embedding_length, shape.hidden),
        (writer.add_feed_forward_length, shape.ffn),
        (writer.add_block_count, shape.layers),
        (writer.add_head_count, shape.heads),
        (writer.add_head_count_kv, shape.kv_heads),
        (writer.add_layer_norm_rms_eps, shape.rms_eps),
        (writer.add_vocab_size, shape.vocab),
    ]:
        add(value)
    rng = np.random.default_rng(0)
    for name, dims, kind in shape.tensors():
        if kind == "norm":
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
        else:
            writer.add_tensor(name, (rng.standard_normal(dims) * 0.02).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
