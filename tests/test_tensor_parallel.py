"""Tensor parallelism over gloo on this CPU: a tiny random Llama split over 2 ranks gives
the single-device engine's tokens (greedy, parallel sampling, beams, preemption, prefix
caching, copy-on-write, under the async engine) and its logits and prompt
log-probabilities within 1e-4; start-up errors name their cause; a killed worker fails
the engine without a hang; two processes started by torchrun on loopback serve one
engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from hf_oracle import make_tiny_model
from live_server import build_chat_model
from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.config import EngineConfig
from pagedllm.entrypoints.cli import main
from pagedllm.errors import InvalidParameterError, TensorParallelError
from pagedllm.loader import load_model
from pagedllm.model.sharding import check_tensor_parallel, shard_config, shard_weights
from pagedllm.worker.runner import PromptLogprobsRow, SampledTokens, SampleRow

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [list(range(3, 3 + n)) for n in (4, 19, 33)] + [[100, 7, 9, 11, 2]]


def generate(llm: LLM, prompts: list[list[int]], params: object = GREEDY) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def assert_pool_whole(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.allocator.num_free_blocks == kv.num_blocks
    assert not kv.tables


@pytest.fixture(scope="module")
def pair(tiny_llama_dir: Path) -> Iterator[tuple[LLM, LLM]]:
    """The model split over 2 ranks, and whole; the same small pool (in blocks), so both
    schedule alike, preemptions included."""
    opts = dict(model=str(tiny_llama_dir), num_kv_blocks=24, block_size=8, watermark=0.0)
    split = LLM(tensor_parallel_size=2, **opts)
    yield split, LLM(**opts)
    workers = {p.pid for p in split.engine.runner.group.procs}
    split.engine.shutdown()
    assert not workers & children()


def test_shards_add_up_to_the_model(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir))
    cfg, w = loaded.config, loaded.weights
    shares = [shard_weights(w, cfg, r, 2) for r in range(2)]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([s[q] for s in shares]), w[q])
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(torch.cat([s[down] for s in shares], dim=1), w[down])
    share = shard_config(cfg, 1, 2)
    assert (share.num_attention_heads, share.num_key_value_heads) == (2, 1)
    # An uneven vocabulary is padded: every rank's logits have the same width.
    table = {"model.embed_tokens.weight": torch.randn(127, 4)}
    padded = shard_weights(table, dataclasses.replace(cfg, vocab_size=127), 1, 2)
    assert padded["model.embed_tokens.weight"].shape == (64, 4)
    assert not padded["model.embed_tokens.weight"][-1].any()
    with pytest.raises(InvalidParameterError) as err:
        check_tensor_parallel(cfg, 3)
    assert err.value.param == "tensor_parallel_size" and "allowed: 1, 2, 4" in str(err.value)


def test_greedy_tokens_and_logits_equal_one_rank(pair: tuple[LLM, LLM]) -> None:
    split, whole = pair
    assert generate(split, PROMPTS) == generate(whole, PROMPTS)
    ids = list(range(1, 70))
    diff = split.engine.runner.logits_of(ids) - whole.engine.runner.logits_of(ids)
    assert diff.abs().max().item() < 1e-4
    assert_pool_whole(split)


def test_prompt_logprobs_equal_one_rank(pair: tuple[LLM, LLM]) -> None:
    """Every rank computes the scored positions' logits (their gathers pair up); the
    driver's values are the single device's."""
    split, whole = pair
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    mine, theirs = (llm.generate(prompts, params, use_tqdm=False) for llm in (split, whole))
    for a, b in zip(mine, theirs, strict=True):
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for got, want in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert set(got) == set(want)
            assert max(abs(got[t] - want[t]) for t in want) < 1e-4
    assert_pool_whole(split)


def test_sampling_and_beam_search_equal_one_rank(pair: tuple[LLM, LLM]) -> None:
    split, whole = pair
    sampled = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    assert generate(split, PROMPTS[:2], sampled) == generate(whole, PROMPTS[:2], sampled)
    beams = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    assert generate(split, PROMPTS[1:3], beams) == generate(whole, PROMPTS[1:3], beams)
    assert_pool_whole(split)


def test_penalties_equal_one_rank(pair: tuple[LLM, LLM]) -> None:
    """The driver samples alone: its runner keeps the penalty counts, under preemption."""
    split, whole = pair
    params = SamplingParams(
        n=2,
        temperature=0.8,
        seed=9,
        max_tokens=24,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.3,
    )
    preempted = split.engine.scheduler.num_preemptions
    assert generate(split, PROMPTS, params) == generate(whole, PROMPTS, params)
    assert split.engine.scheduler.num_preemptions > preempted
    assert_pool_whole(split)


def test_preemption_prefix_caching_and_copy_on_write(
    pair: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    split, whole = pair
    copies: list[tuple[int, int]] = []
    execute = split.engine.runner.execute

    def recording(
        step: SchedulerOutput,
        rows: list[SampleRow],
        grammar_bitmask: object = None,
        prompt_rows: Sequence[PromptLogprobsRow] = (),
    ) -> SampledTokens:
        copies.extend(step.blocks_to_copy)
        return execute(step, rows, grammar_bitmask, prompt_rows)

    monkeypatch.setattr(split.engine.runner, "execute", recording)
    shared = list(range(40, 60))  # two full blocks every prompt starts with
    prompts = [[*shared, i, i + 1, i + 2] for i in range(6)]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    preempted = split.engine.scheduler.num_preemptions
    for batch in (prompts[:1], prompts):  # the first leaves the prefix cached
        assert generate(split, batch, params) == generate(whole, batch, params)
    assert split.engine.scheduler.num_preemptions > preempted
    assert split.engine.scheduler.prefix_hit_tokens > 0
    assert copies  # samples forked from a shared, partly filled block
    assert_pool_whole(split)


def test_the_async_engine_drives_the_split_model(pair: tuple[LLM, LLM]) -> None:
    split, whole = pair
    engine = AsyncLLMEngine(split.engine)

    async def run(rid: str, prompt: list[int]) -> list[int]:
        final = None
        async for out in await engine.add_request(rid, prompt, GREEDY):
            final = out
        assert final is not None
        return final.outputs[0].token_ids

    async def run_all() -> list[list[int]]:
        return await asyncio.gather(*(run(f"a{i}", p) for i, p in enumerate(PROMPTS)))

    try:
        got = asyncio.run(run_all())
    finally:
        engine.shutdown()
    assert got == [o[0] for o in generate(whole, PROMPTS)]


def test_int8_and_a_half_precision_cache_on_every_rank(
    pair: tuple[LLM, LLM], tiny_llama_dir: Path
) -> None:
    _, whole = pair
    model = str(tiny_llama_dir)
    llm = LLM(model, tensor_parallel_size=2, quantization="int8", kv_cache_dtype="float16")
    try:
        ids = list(range(1, 40))
        exact = whole.engine.runner.logits_of(ids)
        error = (llm.engine.runner.logits_of(ids) - exact).norm() / exact.norm()
        assert 0 < error.item() < 0.05  # int8's and float16's rounding, not a broken split
        per_rank, whole_bytes = (x.engine.runner.kv_bytes_per_block(8) for x in (llm, whole))
        assert 4 * per_rank == whole_bytes  # half the KV heads, half the bytes each
    finally:
        llm.engine.shutdown()


def test_start_errors_name_their_cause(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model, before = str(tiny_llama_dir), children()
    with pytest.raises(InvalidParameterError) as err:
        LLM(model, tensor_parallel_size=3)  # 4 heads, 2 KV heads
    assert err.value.param == "tensor_parallel_size"
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(tensor_parallel_size=2, device="cuda:1")
    assert err.value.param == "device"
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(tensor_parallel_size=0)
    assert err.value.param == "tensor_parallel_size"
    if not torch.cuda.is_available():
        with pytest.raises(InvalidParameterError) as err:
            LLM(model, tensor_parallel_size=2, device="cuda")
        assert err.value.param == "tensor_parallel_size"
    # A backend that cannot start on any rank (the CPU kernel wants head_dim % 8 == 0):
    # the error, and no worker left behind.
    odd_heads = str(make_tiny_model(tmp_path, "llama", hidden_size=48))  # head_dim 12
    with pytest.raises(InvalidParameterError) as err:
        LLM(odd_heads, tensor_parallel_size=2, attention_backend="cpu")
    assert err.value.param == "attention_backend"
    assert children() == before


def test_a_killed_worker_fails_the_engine_and_frees_everything(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, num_kv_blocks=64)
    (worker,) = llm.engine.runner.group.procs
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    # Killed while the engine runs: in a collective or between steps, whichever comes.
    killer = threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL))
    killer.start()
    try:
        # The step that finds the worker dead fails the requests it ran, and only them.
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], long, use_tqdm=False)
        errors = [o.error for o in outs if o.error is not None]
        assert errors and all(e.startswith(TensorParallelError.__name__) for e in errors)
        assert_pool_whole(llm)
        assert not worker.is_alive()
        (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], use_tqdm=False)
        assert out.error is not None and "cannot run more steps" in out.error
        assert [c.finish_reason for c in out.outputs] == ["error"]
        assert_pool_whole(llm)
    finally:
        killer.cancel()
        llm.engine.shutdown()


def test_torchrun_two_processes_on_loopback(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(build_chat_model(tmp_path_factory))
    args = ["generate", "--model", model, "--json", "--temperature", "0", "--max-tokens", "8"]
    args += ["--ignore-eos", "The capital of France is", "Hello"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
    launcher += ["--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    launcher += ["--master-port", str(port), "-m", "pagedllm.entrypoints.cli"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    run = subprocess.run(
        [*launcher, *args, "--tensor-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    split = json.loads(run.stdout)
    assert "tensor parallel: 2 ranks over gloo" in run.stderr
    assert main(args) == 0
    assert split["outputs"] == json.loads(capsys.readouterr().out)["outputs"]
    assert split["summary"]["generated_tokens"] == 16


def test_decode_bench_measures_each_size(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out, before = tmp_path / "decode", children()
    args = ["bench", "decode", "--model", str(tiny_llama_dir), "--out", str(out), "--no-hf"]
    args += ["--batch-sizes", "1,2", "--steps", "2", "--prompt-len", "5", "--num-kv-blocks", "64"]
    assert main([*args, "--tensor-parallel-size", "1,2"]) == 0
    rows = json.loads((out / "decode.json").read_text())["results"]
    assert [(r["tp"], r["batch"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all((r["comm_share"] > 0) == (r["tp"] == 2) for r in rows)
    assert children() == before


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_two_gpus_equal_one(tiny_llama_dir: Path) -> None:
    opts = dict(model=str(tiny_llama_dir), device="cuda", block_size=8, num_kv_blocks=64)
    split = LLM(tensor_parallel_size=2, **opts)
    try:
        whole = LLM(**opts)
        assert generate(split, PROMPTS) == generate(whole, PROMPTS)
        ids = list(range(1, 70))
        diff = split.engine.runner.logits_of(ids) - whole.engine.runner.logits_of(ids)
        assert diff.abs().max().item() < 1e-4
    finally:
        split.engine.shutdown()
