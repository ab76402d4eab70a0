"""The scheduler with LoRA adapters in the pool (core/scheduler.py over kv/adapter_pages.py):
admission pins a request's adapter and counts its pages, loads go out once (again after
an eviction), every step names the pages of each adapter it runs, forks share the pin,
finishing, aborting and preempting unpin, check_fits counts the adapter's pages, and a
prefix is reused under its own adapter only. Pure bookkeeping, exact block ids.
"""

from __future__ import annotations

import pytest

from inspect_internals import free_block_ids
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.core.scheduler_output import AdapterLoad, SchedulerOutput
from pagedllm.core.sequence import Request, RequestStatus
from pagedllm.core.sequence import Sequence as Seq
from pagedllm.errors import InvalidParameterError
from pagedllm.kv.adapter_pages import AdapterPoolConfig
from pagedllm.kv.manager import KVCacheManager


def make(
    num_blocks: int = 12,
    block_size: int = 4,
    adapters: AdapterPoolConfig | None = None,
    **config: int,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, adapters=adapters or AdapterPoolConfig())
    settings = {"max_model_len": 64, "max_num_seqs": 8, "max_num_batched_tokens": 64}
    return Scheduler(SchedulerConfig(**(settings | config)), kv)


def add(
    sched: Scheduler, rid: str, prompt: list[int], lora: int = 0, pages: int = 0, slots: int = 1
) -> Request:
    seq = Seq(sched.new_seq_id(), list(prompt), len(prompt))
    req = Request(
        rid,
        [seq],
        num_seq_slots=slots,
        lora_id=lora,
        lora_path=f"/adapters/{lora}" if lora else None,
        lora_pages=pages,
    )
    sched.add_request(req)
    return req


def run(sched: Scheduler, token: int = 1) -> SchedulerOutput:
    """One step: schedule, then every sequence that reached its last token gains one."""
    out = sched.schedule()
    sched.update_from_output(out)
    for s in out.seqs:
        if s.needs_logits:
            req = sched.requests[s.request_id]
            next(q for q in req.seqs if q.seq_id == s.seq_id).token_ids.append(token)
    return out


def finish(sched: Scheduler, req: Request) -> None:
    for seq in list(req.seqs):
        sched.finish_seq(req, seq)


def test_admission_pins_loads_once_and_names_pages_every_step() -> None:
    sched = make()
    kv, ad = sched.kv, sched.kv.adapters
    assert ad is not None
    a = add(sched, "a", [1, 2, 3, 4, 5], lora=1, pages=3)
    b = add(sched, "b", [6, 7, 8])  # the base model
    c = add(sched, "c", [9, 9], lora=1, pages=3)
    out = run(sched)
    assert out.lora_loads == (AdapterLoad(1, "/adapters/1", (0, 1, 2)),)
    assert out.lora_pages == {1: (0, 1, 2)}
    assert [(s.request_id, s.lora_id) for s in out.seqs] == [("a", 1), ("b", 0), ("c", 1)]
    assert kv.block_tables(a.seqs[0].seq_id) == ((3, 4),)
    assert kv.block_tables(b.seqs[0].seq_id) == ((5,),)
    assert kv.block_tables(c.seqs[0].seq_id) == ((6,),)
    assert ad.pins(1) == 2 and ad.num_loads == 1  # one pin per request
    assert kv.usage().adapter_blocks == 3
    out = run(sched)
    assert out.lora_loads == () and out.lora_pages == {1: (0, 1, 2)}
    finish(sched, a)
    assert ad.pins(1) == 1
    finish(sched, c)
    assert ad.pins(1) == 0 and 1 in ad.resident  # resident, unpinned: evictable
    out = run(sched)
    assert out.lora_pages == {} and [s.lora_id for s in out.seqs] == [0]
    finish(sched, b)
    assert kv.num_free_blocks == 9 and kv.num_available_blocks == 12


def test_a_request_waits_for_adapter_pages_then_evicts_the_unpinned() -> None:
    """Pool of 10: adapter 1 (5 pages) and a's 3 blocks leave 2, too few for adapter 2
    (4 pages) and b's 2 blocks; b waits until a finishes. Then the free blocks (cached
    ones included) go first, to the adapter; unpinned adapter 1 is evicted for the rest."""
    sched = make(num_blocks=10)
    ad = sched.kv.adapters
    assert ad is not None
    a = add(sched, "a", list(range(1, 11)), lora=1, pages=5)
    b = add(sched, "b", [11] * 8, lora=2, pages=4)
    out = run(sched)
    assert [s.request_id for s in out.seqs] == ["a"]
    assert out.lora_loads == (AdapterLoad(1, "/adapters/1", (0, 1, 2, 3, 4)),)
    assert sched.num_admissible() == 0
    out = run(sched)  # still waiting
    assert [s.request_id for s in out.seqs] == ["a"] and out.lora_loads == ()
    finish(sched, a)
    assert sched.num_admissible() == 1  # adapter 1's pages count as available
    # Free now: 7, 8, 9, then a's cached 6 and 5 (least recently used last).
    assert free_block_ids(sched.kv.allocator) == [7, 8, 9, 6, 5]
    out = run(sched)
    assert out.lora_loads == (AdapterLoad(2, "/adapters/2", (7, 8, 9, 6)),)
    assert out.lora_pages == {2: (7, 8, 9, 6)}
    assert set(ad.resident) == {2} and ad.num_evictions == 1
    assert sched.kv.block_tables(b.seqs[0].seq_id) == ((0, 1),)


def test_kv_growth_evicts_unpinned_adapters_before_preempting() -> None:
    sched = make(num_blocks=8)
    ad = sched.kv.adapters
    assert ad is not None
    a = add(sched, "a", [1, 2, 3], lora=1, pages=4)
    run(sched)
    finish(sched, a)  # adapter 1 stays resident, unpinned
    b = add(sched, "b", [5] * 8)
    for _ in range(12):  # b grows from 2 blocks to 5: past the 4 free ones
        run(sched)
    assert sched.num_preemptions == 0 and b.num_tokens == 20
    assert ad.num_evictions == 1 and not ad.resident
    assert sched.kv.block_tables(b.seqs[0].seq_id) == ((4, 5, 6, 7, 0),)


def test_preemption_unpins_and_readmission_reloads() -> None:
    """Two adapters pinned, KV runs out: the last admitted request is preempted and its
    adapter unpinned; the survivor grows into its pages (evicting it); readmitted, it is
    loaded again (a new AdapterLoad) into the pages free then."""
    sched = make(num_blocks=9, max_num_batched_tokens=16)
    ad = sched.kv.adapters
    assert ad is not None
    a = add(sched, "a", [1, 2, 3, 4], lora=1, pages=2)
    b = add(sched, "b", [5, 6, 7, 8], lora=2, pages=2)
    out = run(sched)
    assert out.lora_loads == (
        AdapterLoad(1, "/adapters/1", (0, 1)),
        AdapterLoad(2, "/adapters/2", (3, 4)),
    )
    assert sched.kv.block_tables(a.seqs[0].seq_id) == ((2,),)
    assert sched.kv.block_tables(b.seqs[0].seq_id) == ((5,),)
    preempted_at = None
    for step in range(20):
        out = run(sched)
        if out.preempted:
            preempted_at = step
            break
    assert preempted_at is not None and out.preempted == ("b",)
    assert b.status is RequestStatus.WAITING and ad.pins(2) == 0
    assert 2 in ad.resident and ad.num_evictions == 0  # b's own blocks were enough
    for _ in range(20):
        run(sched)
        if 2 not in ad.resident:
            break
    # b's adapter went for a's blocks, a's adapter stayed pinned.
    assert 2 not in ad.resident and ad.pins(1) == 1 and ad.num_evictions == 1
    assert sched.num_preemptions == 1
    assert sched.kv.block_tables(a.seqs[0].seq_id) == ((2, 6, 8, 7, 5, 3),)
    assert free_block_ids(sched.kv.allocator) == [4]
    finish(sched, a)
    out = run(sched)
    assert [s.request_id for s in out.seqs] == ["b"]
    (load,) = out.lora_loads
    assert load == AdapterLoad(2, "/adapters/2", (3, 4)) and ad.resident[2].pages == (3, 4)
    assert sched.kv.block_tables(b.seqs[0].seq_id) == ((5, 7, 8),)
    assert out.lora_pages == {2: load.pages} and ad.num_loads == 3
    assert b.num_preemptions == 1 and ad.pins(2) == 1


def test_forked_sequences_share_the_request_pin_and_abort_unpins() -> None:
    sched = make()
    ad = sched.kv.adapters
    assert ad is not None
    req = add(sched, "r", [1, 2, 3, 4, 5], lora=3, pages=2, slots=2)
    run(sched)
    parent = req.seqs[0]
    child = Seq(sched.new_seq_id(), list(parent.token_ids), parent.num_prompt_tokens, index=1)
    sched.fork(req, parent, child)
    assert sched.kv.tables[child.seq_id].lora_id == 3
    out = run(sched)
    assert [s.lora_id for s in out.seqs] == [3, 3] and out.lora_pages == {3: (0, 1)}
    assert ad.pins(3) == 1
    sched.finish_seq(req, child)
    assert ad.pins(3) == 1  # the request still runs
    waiting = add(sched, "w", [1], lora=4, pages=20)  # never admitted: holds no pin
    sched.abort("w")
    assert waiting.status is RequestStatus.FINISHED and 4 not in ad.resident
    sched.abort("r")
    assert ad.pins(3) == 0 and 3 in ad.resident
    assert sched.kv.num_free_blocks == 10 and not sched.kv.tables


def test_drop_frees_at_the_last_request() -> None:
    sched = make()
    ad = sched.kv.adapters
    assert ad is not None
    a = add(sched, "a", [1, 2], lora=5, pages=2)
    run(sched)
    ad.drop(5)
    out = run(sched)  # a finishes under it
    assert out.lora_pages == {5: (0, 1)}
    finish(sched, a)
    assert not ad.resident and sched.kv.num_free_blocks == 12


def test_static_slots_make_a_request_wait_for_a_slot() -> None:
    sched = make(num_blocks=12, adapters=AdapterPoolConfig("static", 2, 3))
    ad = sched.kv.adapters
    assert ad is not None
    a = add(sched, "a", [1, 2], lora=1, pages=3)
    add(sched, "b", [3, 4], lora=2, pages=1)
    add(sched, "c", [5, 6], lora=3, pages=2)
    out = run(sched)
    assert [s.request_id for s in out.seqs] == ["a", "b"]
    assert out.lora_loads == (
        AdapterLoad(1, "/adapters/1", (0, 1, 2)),
        AdapterLoad(2, "/adapters/2", (3,)),
    )
    assert sched.kv.block_tables(a.seqs[0].seq_id) == ((6,),)
    assert sched.num_admissible() == 1  # an estimate in blocks: slots are not counted
    out = run(sched)
    assert "c" not in out.chunk_sizes  # no slot free, none unpinned
    finish(sched, a)
    out = run(sched)
    assert out.lora_loads == (AdapterLoad(3, "/adapters/3", (0, 1)),)
    assert sched.kv.usage().adapter_blocks == 6


def test_check_fits_counts_adapter_pages() -> None:
    sched = make(num_blocks=10)  # 4-token blocks, max_model_len 64
    sched.check_fits(20, 10, lora_pages=2)  # 8 blocks + 2 pages = 10
    with pytest.raises(InvalidParameterError) as e:
        sched.check_fits(20, 10, lora_pages=3)
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidParameterError) as e:
        sched.check_fits(4, 1, lora_pages=10)
    assert e.value.param == "lora_request"
    static = make(num_blocks=10, adapters=AdapterPoolConfig("static", 2, 2))
    static.check_fits(20, 4, lora_pages=2)  # 6 KV blocks left by the slots
    with pytest.raises(InvalidParameterError) as e:
        static.check_fits(20, 5, lora_pages=2)
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidParameterError) as e:
        static.check_fits(4, 1, lora_pages=3)
    assert e.value.param == "lora_request"
    plain = Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(10, 4))
    with pytest.raises(InvalidParameterError) as e:
        plain.check_fits(4, 1, lora_pages=1)
    assert e.value.param == "lora_request"


def test_prefix_hits_stay_within_an_adapter() -> None:
    """Same prompt: under the same adapter a hit, under another adapter or the base none."""
    sched = make(num_blocks=24)
    prompt = list(range(1, 10))  # two reusable blocks of 4
    first = add(sched, "a1", prompt, lora=1, pages=1)
    run(sched)
    finish(sched, first)
    for rid, lora in (("a2", 1), ("b", 2), ("base", 0), ("a3", 1)):
        req = add(sched, rid, prompt, lora=lora, pages=1 if lora else 0)
        run(sched)
        assert req.num_cached_tokens == (8 if lora == 1 else 0), rid
        finish(sched, req)
    assert sched.prefix_hit_tokens == 16


def test_num_admissible_counts_the_pages_a_pin_takes_out_of_reach() -> None:
    """A resident unpinned adapter's pages count as available, until a request pins it:
    the estimate then counts them against that request, and matches what is admitted."""
    sched = make(num_blocks=10)
    a = add(sched, "a", [1, 2, 3], lora=1, pages=5)
    run(sched)
    finish(sched, a)
    assert sched.kv.num_available_blocks == 10
    add(sched, "b", [4, 5, 6, 7], lora=1, pages=5)  # 1 block + adapter 1's 5 pages
    add(sched, "c", [8, 9, 10, 11], lora=2, pages=4)  # 1 block + 4 pages: 4 left
    assert sched.num_admissible() == 1
    out = run(sched)
    assert list(out.chunk_sizes) == ["b"] and out.lora_loads == ()
    assert sched.kv.adapter_pages_to_pin(1, 5) == 0  # pinned now
    assert sched.kv.adapter_pages_to_pin(2, 4) == 4 and sched.kv.adapter_pages_to_pin(0, 0) == 0
