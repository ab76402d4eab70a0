"""Property test of the scheduler and block manager with a fake model runner.

Random arrivals (some sharing prompt prefixes), lengths, parallel sampling (forks and
copy-on-write), aborts and finishes under a tiny pool. After every step: every block is
free or referenced, each reference count equals the number of block-table entries
pointing at it, used + free = total, every table covers its tokens; at the end the pool
is whole.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.core.sequence import Request, Sequence
from pagedllm.kv.manager import KVCacheManager


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    alloc = kv.allocator
    refs = Counter(b for t in kv.tables.values() for b in t.blocks)
    free = alloc.free_block_ids()
    assert len(free) == len(set(free))
    for block in range(alloc.num_blocks):
        assert alloc.ref_count(block) == refs.get(block, 0)
        assert (block in set(free)) == (refs.get(block, 0) == 0)
    assert alloc.num_used_blocks + alloc.num_free_blocks == alloc.num_blocks
    for table in kv.tables.values():
        assert table.capacity >= table.num_tokens
        # Paged growth: never more than one partly filled block.
        assert len(table.blocks) == -(-table.num_tokens // kv.block_size)
    live = {s.seq_id for r in sched.running for s in r.seqs}
    assert set(kv.tables) == live
    for req in sched.running:
        for seq in req.seqs:
            table = kv.tables[seq.seq_id]
            assert table.num_tokens >= req.num_computed_tokens
            # A block that carries a prefix-cache hash holds exactly this sequence's tokens.
            for i, block in enumerate(table.blocks):
                info = alloc.cached_info(block)
                if info is not None:
                    bs = kv.block_size
                    assert info.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])
    running_seqs = sum(r.max_num_seqs for r in sched.running)
    assert running_seqs <= sched.config.max_num_seqs


def simulate(seed: int, steps: int = 150, caching: bool = True) -> Scheduler:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(12, 40)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    sched = Scheduler(
        SchedulerConfig(
            max_model_len=num_blocks * block_size // 2,
            max_num_seqs=rng.randint(1, 8),
            max_num_batched_tokens=rng.randint(1, 32),
        ),
        kv,
    )
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    limits: dict[str, int] = {}
    next_id = 0
    for _ in range(steps):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
            n = rng.choice([1, 1, 1, 2, 3])
            max_new = rng.randint(1, 30)
            try:
                sched.check_fits(len(prompt), max_new, n)
            except ValueError:
                pass
            else:
                rid = f"r{next_id}"
                next_id += 1
                seq = Sequence(sched.new_seq_id(), list(prompt), len(prompt))
                sched.add_request(Request(rid, [seq], max_num_seqs=n))
                limits[rid] = max_new
        if sched.requests and rng.random() < 0.05:
            sched.abort(rng.choice(list(sched.requests)))
        out = sched.schedule()
        check_invariants(sched)
        sched.update_from_output(out)
        for s in out.seqs:
            if not s.needs_logits or s.request_id not in sched.requests:
                continue
            req = sched.requests[s.request_id]
            seq = next((q for q in req.seqs if q.seq_id == s.seq_id), None)
            if seq is None:
                continue
            targets = [seq]
            if req.max_num_seqs > 1 and len(req.seqs) == 1 and seq.num_output_tokens == 0:
                for _ in range(req.max_num_seqs - 1):
                    child = Sequence(sched.new_seq_id(), list(seq.token_ids), seq.num_prompt_tokens)
                    sched.fork(req, seq, child)
                    targets.append(child)
            for t in targets:
                t.token_ids.append(rng.randrange(50))
                if t.num_output_tokens >= limits[req.request_id] or rng.random() < 0.02:
                    sched.finish_seq(req, t)
        for req in list(sched.running):
            # A beam-search step: a beam forks (sharing every block) and another is dropped.
            if req.max_num_seqs > 1 and req.seqs[0].num_output_tokens > 0 and rng.random() < 0.3:
                parent = rng.choice(req.seqs)
                if len(req.seqs) < req.max_num_seqs:
                    child = Sequence(
                        sched.new_seq_id(), list(parent.token_ids), parent.num_prompt_tokens
                    )
                    sched.fork(req, parent, child)
                if rng.random() < 0.5:
                    sched.finish_seq(req, rng.choice(req.seqs))
        check_invariants(sched)
    for rid in list(sched.requests):
        sched.abort(rid)
    check_invariants(sched)
    assert kv.allocator.num_free_blocks == num_blocks
    assert not kv.tables
    return sched


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=2**32), st.booleans())
def test_pool_stays_consistent(seed: int, caching: bool) -> None:
    simulate(seed, caching=caching)


def test_many_steps_with_preemptions_copies_and_cache_hits(monkeypatch) -> None:
    copies = 0
    take = KVCacheManager.take_copies

    def counting(self: KVCacheManager) -> list[tuple[int, int]]:
        nonlocal copies
        out = take(self)
        copies += len(out)
        return out

    monkeypatch.setattr(KVCacheManager, "take_copies", counting)
    preemptions = hits = 0
    for seed in range(20):
        sched = simulate(seed, steps=400)
        preemptions += sched.num_preemptions
        hits += sched.prefix_hit_tokens
    # The randomized runs really exercise preemption, copy-on-write and the prefix cache.
    assert preemptions > 0 and hits > 0 and copies > 0


def test_requests_run_to_completion_without_aborts() -> None:
    """With no aborts, every admitted request finishes: nothing is stuck."""
    kv = KVCacheManager(10, 4)
    sched = Scheduler(
        SchedulerConfig(max_model_len=40, max_num_seqs=4, max_num_batched_tokens=8), kv
    )
    for i in range(6):
        sched.add_request(Request(f"r{i}", [Sequence(sched.new_seq_id(), [i] * (3 + i), 3 + i)]))
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out)
        for s in out.seqs:
            if s.needs_logits:
                req = sched.requests[s.request_id]
                seq = req.seqs[0]
                seq.token_ids.append(1)
                if seq.num_output_tokens == 10:
                    sched.finish_seq(req, seq)
        check_invariants(sched)
    assert not sched.has_unfinished_requests()
    assert sched.num_preemptions > 0
    assert kv.allocator.num_free_blocks == 10


def test_group_readmission_never_gives_a_hit_away() -> None:
    """A preempted two-sample request comes back under memory pressure: admitting its
    first sample must not evict the cached block its second sample is about to reuse."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    sched = Scheduler(
        SchedulerConfig(max_model_len=24, max_num_seqs=4, max_num_batched_tokens=64), kv
    )
    s0 = Sequence(sched.new_seq_id(), [1, 2, 3, 4], 4)
    req = Request("r", [s0], max_num_seqs=2)
    sched.add_request(req)
    sched.update_from_output(sched.schedule())
    s1 = Sequence(sched.new_seq_id(), [1, 2, 3, 4], 4, index=1)
    sched.fork(req, s0, s1)
    s0.token_ids.append(10)
    s1.token_ids.append(20)
    for t0, t1 in [(11, 21), (12, 22), (13, 23), (14, 24)]:
        sched.update_from_output(sched.schedule())
        s0.token_ids.append(t0)
        s1.token_ids.append(t1)
    assert kv.allocate_slots(999, 4)
    kv.cache_computed_blocks(999, [7, 7, 7, 7], 4)
    sched._preempt(req)
    assert kv.allocate_slots(998, 8)  # another request takes the two uncached blocks
    kv.free(999)
    sched.schedule()
    for seq in (s0, s1):
        if seq.seq_id not in kv.tables:
            continue  # waiting for room: fine
        for i, block in enumerate(kv.table(seq.seq_id).blocks):
            info = kv.allocator.cached_info(block)
            if info is not None:
                assert info.token_ids == tuple(seq.token_ids[i * 4 : (i + 1) * 4])
        assert all(kv.allocator.ref_count(b) == 1 for b in kv.table(seq.seq_id).blocks[1:])
