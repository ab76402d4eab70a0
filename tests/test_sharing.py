"""Sharing KV blocks: fork and copy-on-write, parallel sampling (n, best_of), beam search
against transformers, and automatic prefix caching."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import load_hf
from inspect_internals import block_table, free_block_ids
from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.kv.manager import KVCacheManager
from pagedllm.loader import load_model
from pagedllm.worker.kv_cache import PagedKVCache


def ids(prompt: list[int]) -> dict[str, list[int]]:
    return {"prompt_token_ids": prompt}


def assert_pool_whole(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.allocator.num_free_blocks == kv.num_blocks and not kv.tables


def test_copy_on_write_copies_once_and_leaves_the_parent_untouched(tiny_llama_dir) -> None:
    config = load_model(str(tiny_llama_dir)).config
    kv = KVCacheManager(num_blocks=8, block_size=4)
    cache = PagedKVCache(config, num_blocks=8, block_size=4)
    assert kv.allocate_slots(0, 6)  # blocks [0, 1]; block 1 is half full
    cache.data.normal_()
    parent_before = cache.data.clone()
    kv.fork(0, 1)
    assert block_table(kv, 1).blocks == [0, 1]
    assert [kv.allocator.ref_count(b) for b in (0, 1)] == [2, 2]
    assert kv.usage().shared_blocks == 2 and kv.usage().blocks_saved_by_sharing == 2
    # The child writes token 6, inside shared block 1: one copy, into a fresh block.
    assert kv.allocate_slots(1, 7)
    copies = kv.take_copies()
    assert copies == [(1, 2)] and block_table(kv, 1).blocks == [0, 2]
    cache.copy_blocks(copies)
    cache.data[:, :, 2, 2] = 7.0  # the child's new token
    assert torch.equal(cache.data[:, :, :2], parent_before[:, :, :2])  # parent untouched
    assert torch.equal(cache.data[:, :, 2, :2], parent_before[:, :, 1, :2])
    # The parent now owns block 1 alone and writes in place; full blocks never copy.
    assert kv.allocate_slots(0, 7) and kv.take_copies() == []
    assert kv.allocate_slots(1, 9) and kv.take_copies() == []
    assert block_table(kv, 1).blocks == [0, 2, 3] and kv.allocator.ref_count(0) == 2


def test_parallel_sampling_prefills_once_and_shares_the_prompt(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4)
    engine = llm.engine
    prompt = list(range(10, 20))  # 10 tokens: blocks of 4 + 4 + a half-full one
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    engine.add_request("a", prompt, params)
    engine.step()
    req = engine.scheduler.requests["a"]
    assert len(req.seqs) == 4
    tables = [block_table(engine.kv, s.seq_id).blocks for s in req.seqs]
    assert all(t == tables[0] for t in tables)
    assert [engine.kv.allocator.ref_count(b) for b in tables[0]] == [4, 4, 4]
    usage = engine.usage()
    assert (usage.used_blocks, usage.blocks_saved_by_sharing) == (3, 9)
    engine.step()  # each sample writes into the shared half-full block: 3 copies
    assert [engine.kv.allocator.ref_count(b) for b in tables[0][:2]] == [4, 4]
    assert engine.usage().used_blocks == 2 + 4
    while engine.has_unfinished_requests():
        engine.step()
    # The prompt's 10 tokens were computed once; then 4 samples x 4 decode steps.
    assert engine.stats.tokens_computed == 10 + 4 * 4
    assert_pool_whole(llm)


def test_seeded_parallel_sampling_is_independent_of_the_batch(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=8)
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=10, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    alone = [c.token_ids for c in llm.generate([ids(prompt)], params, use_tqdm=False)[0].outputs]
    assert len({tuple(t) for t in alone}) > 1  # the samples differ from each other
    other = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate(
        [ids([1, 2, 3]), ids(prompt), ids(list(range(30)))], [other, params, other], use_tqdm=False
    )
    assert [c.token_ids for c in mixed[1].outputs] == alone
    assert_pool_whole(llm)


def test_best_of_returns_the_n_most_likely(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    out = llm.generate([ids([3, 1, 4, 1, 5])], params, use_tqdm=False)[0]
    everything = llm.generate(
        [ids([3, 1, 4, 1, 5])],
        SamplingParams(n=5, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )[0]
    ranked = sorted(everything.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beam_search_equals_transformers(tiny_llama_dir, width, length_penalty) -> None:
    hf = load_hf(tiny_llama_dir)
    llm = LLM(str(tiny_llama_dir), block_size=4)
    g = torch.Generator().manual_seed(width)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 17)]
    params = BeamSearchParams(
        beam_width=width, max_tokens=10, ignore_eos=True, length_penalty=length_penalty
    )
    outs = llm.beam_search([ids(p) for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        x = torch.tensor([prompt])
        y = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            num_beams=width,
            do_sample=False,
            max_new_tokens=10,
            length_penalty=length_penalty,
            early_stopping=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        assert out.outputs[0].token_ids == y[0, len(prompt) :].tolist()
        assert len(out.outputs) == width
    assert_pool_whole(llm)


def test_beam_search_survives_preemption(tiny_llama_dir) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    prompts = [ids(list(range(i, i + 9))) for i in range(6)]
    roomy = LLM(str(tiny_llama_dir), block_size=4)
    expected = [o.outputs[0].token_ids for o in roomy.beam_search(prompts, params, use_tqdm=False)]
    tight = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=20, watermark=0.0)
    got = [o.outputs[0].token_ids for o in tight.beam_search(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert_pool_whole(tight)


def test_prefix_cache_computes_only_the_uncached_tail(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4)
    engine = llm.engine
    prompt = list(range(40, 70))  # 30 tokens: 7 full blocks of 4, then 2 tokens
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([ids(prompt)], greedy, use_tqdm=False)[0]
    before = engine.stats.tokens_computed
    second = llm.generate([ids(prompt)], greedy, use_tqdm=False)[0]
    # 28 tokens came from the cache: only the last 2 prompt tokens, then 3 decodes, ran.
    assert second.num_cached_tokens == 28
    assert engine.stats.tokens_computed - before == 2 + 3
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.scheduler.prefix_hit_rate == pytest.approx(28 / 60)
    # A prompt that is all full blocks still recomputes its last block's tokens.
    whole = list(range(40, 68))
    third = llm.generate([ids(whole)], greedy, use_tqdm=False)[0]
    assert third.num_cached_tokens == 24
    assert_pool_whole(llm)


def test_prefix_caching_on_and_off_give_identical_outputs(tiny_llama_dir) -> None:
    shared = list(range(1, 21))
    prompts = [ids([*shared, i, i + 1, i + 2]) for i in range(30, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    on = LLM(str(tiny_llama_dir), block_size=4, max_num_seqs=3)
    off = LLM(str(tiny_llama_dir), block_size=4, max_num_seqs=3, enable_prefix_caching=False)
    out_on = on.generate(prompts, params, use_tqdm=False)
    out_off = off.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out_on] == [o.outputs[0].token_ids for o in out_off]
    assert on.engine.scheduler.prefix_hit_tokens > 0
    assert off.engine.scheduler.prefix_hit_tokens == 0


def test_prefix_cache_evicts_least_recently_used_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, b = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]
    for seq_id, tokens in ((0, a), (1, b)):
        assert kv.allocate_slots(seq_id, len(tokens))
        kv.cache_computed_blocks(seq_id, tokens, len(tokens))
    assert block_table(kv, 0).blocks == [0, 1, 2] and block_table(kv, 1).blocks == [3, 4, 5]
    kv.free(0)
    kv.free(1)
    # Tails first, so a prefix's head outlives its tail; uncached block 2 and 5 lead.
    assert free_block_ids(kv.allocator) == [5, 2, 1, 0, 4, 3]
    assert kv.lookup_prefix([a])[0].tables == ((0, 1),)
    assert kv.allocate_slots(2, 2) and block_table(kv, 2).blocks == [5]
    assert kv.allocate_slots(3, 2) and block_table(kv, 3).blocks == [2]
    assert kv.allocate_slots(4, 2) and block_table(kv, 4).blocks == [1]  # evicts a's second block
    assert kv.lookup_prefix([a])[0].tables == ((0,),)
    assert kv.lookup_prefix([b])[0].tables == ((3, 4),)


def test_cached_tokens_are_counted_at_first_admission_and_kept_after_preemption(
    tiny_llama_dir,
) -> None:
    """num_cached_tokens, as vLLM: what the prefix cache served when the request was
    first admitted; a recomputation after preemption (which finds its own blocks cached,
    or fewer) does not change it."""
    # 28 blocks: the last request is preempted and readmitted finding 28 of its own
    # tokens cached, where it first found the 12 shared ones.
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=28, watermark=0.0)
    shared = list(range(30, 43))  # 13 tokens: 3 full blocks of 4
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    assert llm.generate([ids(shared)], greedy, use_tqdm=False)[0].num_cached_tokens == 0
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [ids([*shared, 100 + i, 110 + i]) for i in range(4)]
    outs = llm.generate(prompts, long, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.num_preemptions > 0 for o in outs)
    assert [o.num_cached_tokens for o in outs] == [12] * 4
    assert_pool_whole(llm)
