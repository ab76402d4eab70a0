"""Layer groups of the KV cache (the hybrid manager) for sliding-window models.

Bookkeeping with exact block ids: a window group gives its blocks behind the window back
as a sequence grows (null entries), a prefix hit on a window group needs only the
window's blocks, copy-on-write happens per group. Against transformers: a tiny Gemma 3
(two window groups and one full group) and a tiny Mistral (every layer windowed), with
the hybrid manager and with `disable_hybrid_kv_cache_manager`, batched, chunked,
preempted and prefix-cached, give the oracle's greedy tokens and leave the pool whole;
the compiled kernel never reads the null block; a long generation holds nothing behind
the window.
"""

from __future__ import annotations

import pytest
import torch

from hf_oracle import hf_greedy, load_hf, make_tiny_model
from pagedllm import LLM, SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import KV_CACHE_EXCEEDED, InvalidParameterError
from pagedllm.kv.attention_kinds import FullAttention, SlidingWindow
from pagedllm.kv.groups import KVGroupSpec, group_layers, kv_bytes_per_sequence
from pagedllm.kv.manager import KVCacheManager
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec

W = 8  # the tiny models' window
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Gemma 3's pattern, shortened: windowed, windowed, full (x2) -> 1 full + 2 window groups.
GEMMA_LAYERS = ["sliding_attention", "sliding_attention", "full_attention"] * 2


# ------------------------------------------------------------------ groups
def test_group_layers_of_gemma3_270m() -> None:
    windows = ([512] * 5 + [None]) * 3  # 18 layers, 5 of every 6 windowed
    groups = group_layers(windows, 18)
    assert [g.window for g in groups] == [None] + [512] * 5
    assert groups[0].layers == (5, 11, 17)
    assert groups[1].layers == (0, 1, 2) and groups[5].layers == (14, 15, 16)
    assert sorted(layer for g in groups for layer in g.layers) == list(range(18))
    assert group_layers(windows, 18, hybrid=False) == (
        KVGroupSpec(FullAttention(), tuple(range(18))),
    )


def test_one_kind_is_one_group() -> None:
    assert group_layers(None, 4) == (KVGroupSpec(FullAttention(), (0, 1, 2, 3)),)
    # Mistral: one window group
    assert group_layers([8, 8], 2) == (KVGroupSpec(SlidingWindow(8), (0, 1)),)


def test_group_spec_is_validated() -> None:
    with pytest.raises(ValueError, match="window"):
        SlidingWindow(0)
    with pytest.raises(ValueError, match="AttentionKind"):
        KVGroupSpec(8, (0,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one layer"):
        KVGroupSpec(FullAttention(), ())
    with pytest.raises(ValueError, match="distinct"):
        KVGroupSpec(FullAttention(), (1, 1))


def test_hybrid_holds_less_per_long_sequence() -> None:
    windows = ([512] * 5 + [None]) * 3
    per_layer_token = 2 * 1 * 256 * 2  # Gemma 3 270M: 1 KV head of 256, bf16
    hybrid = kv_bytes_per_sequence(group_layers(windows, 18), 8192, 16, per_layer_token)
    full = kv_bytes_per_sequence(group_layers(windows, 18, False), 8192, 16, per_layer_token)
    assert full == 8192 * 18 * per_layer_token
    # 3 full layers over 8192 tokens, 15 windowed over 33 blocks of 16 (512 + one block).
    assert hybrid == (3 * 8192 + 15 * 33 * 16) * per_layer_token


# ---------------------------------------------------------- bookkeeping
def manager(num_blocks: int = 16) -> KVCacheManager:
    """Block size 4, a full group and a window group of 8 tokens."""
    return KVCacheManager(
        num_blocks,
        4,
        groups=(KVGroupSpec(FullAttention(), (1,)), KVGroupSpec(SlidingWindow(W), (0,))),
    )


def grow(kv: KVCacheManager, seq_id: int, tokens: list[int], start: int, end: int) -> None:
    """Compute tokens [start, end) one at a time (decode), caching full blocks."""
    for n in range(start + 1, end + 1):
        assert kv.allocate_slots(seq_id, n)
        kv.cache_computed_blocks(seq_id, tokens, n)


def test_window_group_gives_back_blocks_behind_its_window() -> None:
    kv = manager()
    null = kv.null_block
    assert null == 16  # past the pool: never handed out, never counted
    tokens = list(range(100, 124))
    grow(kv, 0, tokens, 0, 11)
    assert kv.block_tables(0) == ((0, 2, 4), (1, 3, 5))
    # Computing token 11 needs keys from 4 on: block 0 of the window group is behind.
    grow(kv, 0, tokens, 11, 12)
    assert kv.block_tables(0) == ((0, 2, 4), (null, 3, 5))
    grow(kv, 0, tokens, 12, 20)
    assert kv.block_tables(0) == ((0, 2, 4, 6, 8), (null, null, null, 7, 9))
    assert kv.num_dropped_blocks == 3
    usage = kv.usage()
    assert (usage.used_blocks, usage.free_blocks, usage.block_references) == (7, 9, 7)
    kv.free(0)
    assert kv.num_free_blocks == 16 and not kv.tables


def test_prefix_hit_on_a_window_group_needs_only_the_window() -> None:
    kv = manager()
    tokens = list(range(100, 124))
    grow(kv, 0, tokens, 0, 20)
    kv.free(0)
    # Another request takes the six uncached blocks and then the least recently used
    # cached ones: the window group's first blocks given back (1 and 3) are evicted.
    assert kv.allocate_slots(1, 16)
    assert kv.block_tables(1) == ((10, 11, 12, 13), (14, 15, 1, 3))
    assert kv.allocator.num_evictions == 2
    kv.free(1)
    hit = kv.lookup_prefix([tokens[:21]])[0]
    # 20 tokens cached: the window group reads blocks 3 and 4 (tokens 13..19) next.
    assert hit.num_blocks == 5
    null = kv.null_block
    assert hit.tables == ((0, 2, 4, 6, 8), (null, null, null, 7, 9))
    assert kv.admit([2], [hit], 21)
    assert kv.block_tables(2)[1][:5] == (null, null, null, 7, 9)
    kv.free(2)
    assert kv.num_free_blocks == 16


def test_copy_on_write_per_group() -> None:
    kv = manager()
    assert kv.allocate_slots(0, 6)  # two blocks in each group, the second half full
    kv.fork(0, 1)
    assert kv.allocate_slots(1, 7)
    assert kv.take_copies() == [(1, 4), (3, 5)]  # the shared partial block of each group
    assert kv.block_tables(0) == ((0, 1), (2, 3))
    assert kv.block_tables(1) == ((0, 4), (2, 5))
    assert [kv.allocator.ref_count(b) for b in range(6)] == [2, 1, 2, 1, 1, 1]
    for seq_id in (0, 1):
        kv.free(seq_id)
    assert kv.num_free_blocks == 16


def test_admission_counts_every_group_and_refuses_what_never_fits() -> None:
    windows = (W, W, None)  # one full group and two window groups, of one layer each
    spec = ModelSpec(100, 4096, num_layers=3, layer_windows=windows)
    config = EngineConfig(block_size=4, num_kv_blocks=20, max_num_batched_tokens=8)
    engine = LLMEngine(config, runner=FakeModelRunner(spec, token=1))
    assert [g.window for g in engine.kv.groups] == [None, W, W]
    # The longest sequence the pool holds: 10 full-group blocks and 5 in each window group.
    assert engine.max_model_len == 40
    config = EngineConfig(
        block_size=4, num_kv_blocks=20, max_num_batched_tokens=8, max_model_len=200
    )
    engine = LLMEngine(config, runner=FakeModelRunner(spec, token=1))
    # 64 tokens: 16 blocks in the full group and at most 5 in each window group (keys of
    # 8 - 1 + 8 tokens for a chunk of 8), 26 > 20 blocks.
    with pytest.raises(InvalidParameterError) as err:
        engine.add_request("big", [1] * 40, SamplingParams(max_tokens=24))
    assert err.value.code == KV_CACHE_EXCEEDED
    engine.add_request("fits", [1] * 30, SamplingParams(max_tokens=10, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_blocks == 20


# ------------------------------------------------------------- the oracle
@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3-hybrid")
    return make_tiny_model(path, "gemma3", num_hidden_layers=6, layer_types=GEMMA_LAYERS)


@pytest.fixture(scope="module")
def models(gemma_dir, family_dir):
    return {"gemma3": gemma_dir, "mistral": family_dir("mistral")}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 128, (14,), generator=g).tolist()
    tails = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 27)]
    return [shared + t for t in tails] + [[7, 8, 9]]


@pytest.fixture(scope="module")
def oracle(models, prompts):
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            hf = load_hf(models[arch])
            cache[arch] = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
        return cache[arch]

    return get


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.tables  # the pool is whole
    return [o.outputs[0].token_ids for o in outs]


# Pools small enough to preempt, large enough for the longest request (53 tokens).
PREEMPTING_POOL = {("gemma3", True): 30, ("gemma3", False): 15}
PREEMPTING_POOL |= {("mistral", True): 7, ("mistral", False): 15}


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_chunked_and_cached_greedy_equals_transformers(arch, models, prompts, oracle) -> None:
    llm = LLM(str(models[arch]), block_size=4, max_num_batched_tokens=6)
    kv = llm.engine.kv
    assert kv.num_groups == (3 if arch == "gemma3" else 1)
    assert kv.windows[-1] == W
    assert generate(llm, prompts) == oracle(arch)
    assert kv.num_dropped_blocks > 0
    # Again, batched: the prompts' shared prefix now comes from the prefix cache.
    before = llm.engine.scheduler.prefix_hit_tokens
    assert generate(llm, prompts) == oracle(arch)
    assert llm.engine.scheduler.prefix_hit_tokens > before


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_preempted_greedy_equals_transformers(arch, hybrid, models, prompts, oracle) -> None:
    llm = LLM(
        str(models[arch]),
        block_size=4,
        num_kv_blocks=PREEMPTING_POOL[arch, hybrid],
        max_num_batched_tokens=8,
        max_model_len=64,
        watermark=0.0,
        disable_hybrid_kv_cache_manager=not hybrid,
    )
    assert llm.engine.kv.num_groups == (3 if arch == "gemma3" and hybrid else 1)
    assert (llm.engine.kv.null_block is not None) == hybrid
    assert generate(llm, prompts) == oracle(arch)
    assert llm.engine.scheduler.num_preemptions > 0


def test_the_compiled_kernel_never_reads_the_null_block(models, prompts, oracle) -> None:
    """NaN in the null block changes nothing: the kernel reads nothing behind the window.
    (The reference gathers it, then masks it: nothing writes it, so it stays zeros.)"""
    llm = LLM(str(models["gemma3"]), block_size=4, attention_backend="cpu")
    llm.engine.runner.kv_cache.data[:, :, llm.engine.kv.null_block] = float("nan")
    assert generate(llm, prompts) == oracle("gemma3")


def test_nothing_is_held_behind_the_window(models) -> None:
    llm = LLM(str(models["gemma3"]), block_size=4)
    engine, kv = llm.engine, llm.engine.kv
    engine.add_request("long", [3] * 10, SamplingParams(max_tokens=30, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in kv.tables.values():
            for g, table in enumerate(seq.groups):
                if kv.windows[g] is not None and table.num_tokens > 10:  # decoding
                    most = max(most, len(table.real_blocks()))
    assert most == -(-W // 4) + 1  # the window's blocks and the one being written
    assert kv.num_free_blocks == kv.num_blocks


# ------------------------------------------------------------- read side
def test_flag_snapshot_and_documented_figures() -> None:
    import argparse

    from pagedllm.bench.layer_groups import arithmetic
    from pagedllm.entrypoints.engine_args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert not engine_config(parser.parse_args([])).disable_hybrid_kv_cache_manager
    args = parser.parse_args(["--disable-hybrid-kv-cache-manager"])
    assert engine_config(args).disable_hybrid_kv_cache_manager

    spec = ModelSpec(100, 4096, num_layers=3, layer_windows=(W, W, None))
    config = EngineConfig(block_size=4, num_kv_blocks=40, max_num_batched_tokens=4)
    engine = LLMEngine(config, runner=FakeModelRunner(spec, token=1))
    engine.add_request("r", [1] * 30, SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(9):
        engine.step()
    snap = engine.snapshot(tables=True)
    assert snap.group_windows == (None, W, W)
    ((table),) = snap.tables
    # The step computed token 30: 8 blocks in the full group; a window group keeps the
    # blocks of its keys, from 30 - 8 + 1 = 23 (block 5) to 30 (block 7).
    assert (table.num_tokens, table.group_blocks) == (31, (8, 3, 3))
    assert snap.num_dropped_blocks == 10

    # docs/kv_cache.md's figures, from the groups.
    bf16 = arithmetic(8192, 16, 2)
    assert (bf16["hybrid_bytes"], bf16["full_bytes"]) == (33_275_904, 150_994_944)


def test_bench_budgets_are_the_same_bytes(gemma_dir) -> None:
    from pagedllm.bench.options import blocks_per_full_block, kv_budget_tokens
    from pagedllm.loader import load_model

    loaded = load_model(str(gemma_dir))  # 6 layers in groups of 2
    assert blocks_per_full_block(loaded, {}) == 3
    assert blocks_per_full_block(loaded, {"disable_hybrid_kv_cache_manager": True}) == 1
    assert kv_budget_tokens(loaded, {"num_kv_blocks": 768, "block_size": 16}) == 4096
