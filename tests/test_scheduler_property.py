"""Property tests of the scheduler and the block manager, driven through the engine's own
`step()` with a fake model runner (random tokens, no model).

Random arrivals (some sharing prompt prefixes), lengths, parallel sampling and best_of
(forks and copy-on-write), beam searches (forks and dropped beams), EOS, aborts and
preemptions under a tiny pool, with and without speculative decoding (the fake runner
keeps a deterministic share of the n-gram proposals, from none to all), and requests
that score their prompt (prompt_logprobs: no prefix-cache hit, every prompt token scored
in every output, through preemptions). After every
step: every block is free or referenced, each reference count equals the number of
block-table entries pointing at it, used + free = total, every table covers its tokens;
at the end the pool is whole. At every step the runner's copies of the block tables, kept
from the scheduler's changes alone (the fake runner's lists and the real runner's
tensors, worker/input_batch.py), equal the manager's tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inspect_internals import block_table, free_block_ids, runner_tables
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.core.scheduler_output import ScheduledSeq, SchedulerOutput, TableEdit
from pagedllm.core.sequence import Request
from pagedllm.core.sequence import Sequence as Seq
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import InvalidParameterError
from pagedllm.kv.adapter_pages import AdapterPoolConfig
from pagedllm.kv.manager import KVCacheManager
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.worker.batch_tables import BatchTables, ListTableStore
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.runner import ModelSpec, PromptLogprobsRow, SampledTokens, SampleRow

VOCAB = 50
EOS = 0


class CountingRunner(FakeModelRunner):
    """Random tokens; counts the copy-on-write copies the engine asked for, and the
    tables sent whole and as appended ids (none included); holds its copies of the block
    tables against `kv` (the engine's manager) at every step, keeping what differs in
    `mismatches` (the engine would take an exception here for a failed forward pass)."""

    def __init__(
        self, seed: int, num_layers: int = 1, windows: tuple[int | None, ...] | None = None
    ) -> None:
        spec = ModelSpec(VOCAB, 4096, (EOS,), num_layers=num_layers, layer_windows=windows)
        super().__init__(spec, seed=seed)
        self.copies = 0
        self.whole_tables = self.appended_tables = 0
        self.truncated_tables = self.nulled_tables = 0  # edits: entries lost, entries nulled
        self.kv: KVCacheManager | None = None
        self.mismatches: list[str] = []
        self.input_batch: InputBatch | None = None

    def execute(
        self,
        step: SchedulerOutput,
        rows: Sequence[SampleRow],
        grammar_bitmask: object = None,
        prompt_rows: Sequence[PromptLogprobsRow] = (),
    ) -> SampledTokens:
        self.copies += len(step.blocks_to_copy)
        self.whole_tables += sum(s.replaces_tables for s in step.seqs)
        self.appended_tables += sum(not s.replaces_tables for s in step.seqs)
        edits = [e for s in step.seqs for e in s.table_edits if e is not None]
        self.truncated_tables += sum(e.keep < len(t) for e, t in self.edited(step))
        self.nulled_tables += sum(e.null_start < min(e.null_stop, e.keep) for e in edits)
        self.check_whole_tables(step)
        sampled = super().execute(step, rows, grammar_bitmask, prompt_rows)
        if self.input_batch is None:  # tables as small as can be: the runs make them grow
            self.input_batch = InputBatch(self.tables.num_groups, rows=1, entries=1)
        gathered = self.input_batch.step_tables(step)
        kv = self.kv
        assert kv is not None
        if not set(self.tables.row_of) <= set(kv.tables):
            self.mismatches.append(f"rows outlive their sequences: {self.tables.row_of}")
        if self.tables.row_of != self.input_batch.mirror.row_of:
            self.mismatches.append("the list and tensor copies hold different rows")
        for i, s in enumerate(step.seqs):
            want = kv.block_tables(s.seq_id)
            got = runner_tables(self.tables, s.seq_id)
            # The step's tables as the real runner gathers them, each row padded with 0.
            padded = [[*t, *[0] * (gathered[g].shape[1] - len(t))] for g, t in enumerate(want)]
            if got != want or [gathered[g][i].tolist() for g in range(len(want))] != padded:
                self.mismatches.append(f"sequence {s.seq_id}: {got} (runner) != {want}")
        return sampled

    def edited(self, step: SchedulerOutput) -> list[tuple[TableEdit, tuple[int, ...]]]:
        """Each edit of the step with the runner's table it applies to (before the step)."""
        return [
            (e, runner_tables(self.tables, s.seq_id)[g])
            for s in step.seqs
            for g, e in enumerate(s.table_edits)
            if e is not None
        ]

    def check_whole_tables(self, step: SchedulerOutput) -> None:
        """A sequence the runner holds (and keeps this step) gets its tables whole only
        after an entry was replaced in place: a copy-on-write into its tables this step.
        A truncation or blocks given back behind a window come as edits."""
        kv = self.kv
        assert kv is not None
        gone = {*step.finished_seq_ids, *step.preempted_seq_ids}
        copied = {dst for _, dst in step.blocks_to_copy}
        for s in step.seqs:
            if not s.replaces_tables or s.seq_id not in self.tables.row_of or s.seq_id in gone:
                continue
            if not copied & {b for t in kv.block_tables(s.seq_id) for b in t}:
                self.mismatches.append(f"sequence {s.seq_id}: whole tables with no rewrite")


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    alloc = kv.allocator
    bs = kv.block_size
    # Reference counts equal the table entries pointing at a block, summed over groups;
    # a page an adapter holds (LoRA) has one reference of its own and is in no table.
    refs = Counter(b for t in kv.tables.values() for b in t.blocks)
    pages = adapter_pages(kv)
    assert not pages.keys() & refs.keys()
    free = free_block_ids(alloc)
    assert len(free) == len(set(free))
    for block in range(alloc.num_blocks):
        assert alloc.ref_count(block) == refs.get(block, 0) + (block in pages)
        assert (block in set(free)) == (alloc.ref_count(block) == 0)
        if block in pages:
            assert alloc.cached_info(block) is None
    assert alloc.num_used_blocks + alloc.num_free_blocks == alloc.num_blocks
    chunk = sched.config.max_num_batched_tokens
    for seq in kv.tables.values():
        assert seq.capacity >= seq.num_tokens
        for g, table in enumerate(seq.groups):
            assert table.num_tokens == seq.num_tokens
            # Null entries (given back behind a window) come first, pool blocks after.
            window = kv.windows[g]
            assert table.blocks[: table.num_dropped] == [kv.null_block] * table.num_dropped
            assert kv.null_block not in table.real_blocks()
            if window is None:
                assert table.num_dropped == 0
            else:  # nothing held behind the window of the last chunk computed
                written = -(-table.num_tokens // bs)  # blocks reserved ahead left out
                real = table.blocks[table.num_dropped : written]
                assert len(real) <= -(-(window - 1 + chunk) // bs) + 1
    live = {s.seq_id for r in sched.running for s in r.seqs}
    assert set(kv.tables) == live
    for req in sched.running:
        for seq in req.seqs:
            tables = kv.tables[seq.seq_id]
            assert tables.num_tokens >= req.num_computed_tokens
            # Paged growth: never more than one partly filled block (or the reservation).
            for table in tables.groups:
                expected = max(-(-table.num_tokens // bs), -(-req.reserve_tokens // bs))
                assert len(table.blocks) == expected
            # A block that carries a prefix-cache hash holds exactly this sequence's tokens,
            # cached in the group whose table holds it.
            for g, table in enumerate(tables.groups):
                for i, block in enumerate(table.blocks):
                    info = alloc.cached_info(block) if block != kv.null_block else None
                    if info is not None:
                        assert info.group == g
                        assert info.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])
    running_seqs = sum(r.num_seq_slots for r in sched.running)
    assert sched._running_seq_slots == running_seqs  # kept incrementally
    assert running_seqs <= sched.config.max_num_seqs
    # The pool's figures, kept incrementally, equal a count over every table.
    filled: dict[int, int] = {}
    for seq in kv.tables.values():
        for table in seq.groups:
            for i, block in enumerate(table.blocks):
                if block != kv.null_block:
                    n = min(bs, max(0, table.num_tokens - i * bs))
                    filled[block] = max(filled.get(block, 0), n)
    usage = kv.usage()
    assert usage.adapter_blocks == len(pages)
    assert usage.used_blocks + usage.adapter_blocks + usage.free_blocks == usage.num_blocks
    assert usage.tokens_stored == sum(filled.values())
    assert usage.block_references == sum(len(t.blocks) for t in kv.tables.values())
    assert usage.shared_blocks == sum(1 for b in filled if alloc.ref_count(b) > 1)


def adapter_pages(kv: KVCacheManager) -> dict[int, int | None]:
    """Page -> the adapter resident in it (None: a static slot's page no adapter uses);
    every page held once."""
    ad = kv.adapters
    if ad is None:
        return {}
    pages: dict[int, int | None] = {}
    if ad.static:
        pages = {b: None for b in range(ad.config.reserved_blocks)}  # a fresh pool's first
    for lora_id, resident in ad.resident.items():
        for page in resident.pages:
            assert pages.get(page) is None, f"page {page} held twice"
            pages[page] = lora_id
    assert len(pages) == ad.held_blocks()
    return pages


def random_layers(rng: random.Random, hybrid: bool) -> tuple[int, tuple[int | None, ...] | None]:
    """(layers, their windows): one kind of attention, or a mix of full and windowed
    layers (Gemma 3's pattern), or every layer windowed (Mistral's)."""
    if not hybrid:
        return 1, None
    window = rng.randint(1, 12)
    kind = rng.choice(["gemma", "mistral", "two windows"])
    if kind == "gemma":
        windows: tuple[int | None, ...] = (window, window, None) * rng.randint(1, 2)
    elif kind == "mistral":
        windows = (window,) * rng.randint(1, 3)
    else:
        windows = (window, None, window + 3, None)
    return len(windows), windows


def random_params(rng: random.Random) -> SamplingParams | BeamSearchParams:
    max_tokens = rng.randint(1, 30)
    kind = rng.random()
    if kind < 0.15:
        return BeamSearchParams(beam_width=rng.choice([2, 3]), max_tokens=max_tokens)
    n = rng.choice([1, 1, 1, 2, 3])
    best_of = n + 1 if kind < 0.25 else None
    return SamplingParams(
        n=n,
        best_of=best_of,
        max_tokens=max_tokens,
        ignore_eos=rng.random() < 0.5,
        # computes its whole prompt: no prefix-cache hit
        prompt_logprobs=rng.choice([None, None, None, 0, 2]),
    )


def simulate(
    seed: int,
    steps: int = 150,
    caching: bool = True,
    hybrid: bool = False,
    speculative: bool = False,
) -> LLMEngine:
    """`hybrid`: a model with sliding-window layers, so several layer groups;
    `speculative`: n-gram proposals, checked (some kept, some not) by the fake runner."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(12, 40)
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_model_len=num_blocks * block_size // 2,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(1, 32),
        enable_prefix_caching=caching,
    )
    num_layers, windows = random_layers(rng, hybrid)
    if hybrid and not speculative:  # reservations: every group reserves, windows give back
        policy = rng.choice(["paged", "paged", "reserve-max", "reserve-pow2"])
        config = dataclasses.replace(config, kv_reservation=policy)
    if speculative:
        config = dataclasses.replace(
            config,
            speculative_method="ngram",
            num_speculative_tokens=rng.randint(1, 6),
            prompt_lookup_min=1,
            prompt_lookup_max=rng.randint(1, 3),
            speculative_disable_by_batch_size=rng.choice([None, None, 3]),
        )
    runner = CountingRunner(rng.randrange(2**32), num_layers, windows)
    engine = LLMEngine(config, runner=runner)
    runner.kv = engine.kv
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    next_id = 0
    scored: dict[str, bool] = {}  # request id -> whether it asked for prompt_logprobs
    for _ in range(steps):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
            # A request that could never fit this pool is rejected up front, holding nothing.
            params = random_params(rng)
            with contextlib.suppress(InvalidParameterError):
                engine.add_request(f"r{next_id}", prompt, params)
            scored[f"r{next_id}"] = getattr(params, "prompt_logprobs", None) is not None
            next_id += 1
        if engine.scheduler.requests and rng.random() < 0.05:
            engine.abort(rng.choice(list(engine.scheduler.requests)))
        for out in engine.step():
            # A request that asked for its prompt's scores has them all, whatever hit the
            # prefix cache or was preempted (every output carries the prompt: CUMULATIVE).
            assert out.error is None
            if scored.get(out.request_id):
                assert out.prompt_logprobs is not None and out.prompt_token_ids is not None
                assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
                assert out.prompt_logprobs[0] is None and all(out.prompt_logprobs[1:])
            else:
                assert out.prompt_logprobs is None
        check_invariants(engine.scheduler)
        assert not runner.mismatches
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    check_invariants(engine.scheduler)
    assert engine.kv.allocator.num_free_blocks == num_blocks
    assert not engine.kv.tables
    return engine


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=2**32), st.booleans())
def test_pool_stays_consistent(seed: int, caching: bool) -> None:
    simulate(seed, caching=caching)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=2**32), st.booleans())
def test_pool_stays_consistent_with_layer_groups(seed: int, caching: bool) -> None:
    simulate(seed, caching=caching, hybrid=True)


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=0, max_value=2**32), st.booleans(), st.booleans())
def test_pool_stays_consistent_with_speculation(seed: int, caching: bool, hybrid: bool) -> None:
    simulate(seed, caching=caching, hybrid=hybrid, speculative=True)


def test_speculation_accepts_rejects_preempts_and_hits() -> None:
    """Randomized speculative runs keep some proposals and reject others, preempt and hit
    the prefix cache; with a fake runner that keeps every or no proposal, too."""
    proposed = accepted = preemptions = hits = truncated = nulled = 0
    for seed in range(12):
        engine = simulate(seed, steps=300, hybrid=seed % 2 == 1, speculative=True)
        snap = engine.snapshot()
        proposed += snap.spec_proposed_tokens
        accepted += snap.spec_accepted_tokens
        preemptions += engine.scheduler.num_preemptions
        hits += engine.scheduler.prefix_hit_tokens
        truncated += engine.runner.truncated_tables
        nulled += engine.runner.nulled_tables
    assert 0 < accepted < proposed and preemptions > 0 and hits > 0
    # Rejected lookahead given back, and blocks behind windows, reached the runner as
    # edits of its tables (checked against the manager's at every step), not whole tables.
    assert truncated > 0 and nulled > 0
    for keep_all in (False, True):
        config = EngineConfig(
            block_size=2,
            num_kv_blocks=16,
            max_model_len=32,
            max_num_batched_tokens=16,
            speculative_method="ngram",
            num_speculative_tokens=3,
            prompt_lookup_min=1,
        )
        runner = FakeModelRunner(
            ModelSpec(VOCAB, 4096),
            token=1,
            num_accepted=lambda row, keep_all=keep_all: len(row.draft_token_ids) * keep_all,
        )
        engine = LLMEngine(config, runner=runner)
        for i in range(4):
            engine.add_request(f"r{i}", [i + 1] * 3, SamplingParams(max_tokens=12, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
            check_invariants(engine.scheduler)
        assert done == {f"r{i}": [1] * 12 for i in range(4)}
        assert engine.kv.allocator.num_free_blocks == 16
        snap = engine.snapshot()
        assert snap.spec_proposed_tokens > 0
        assert snap.spec_accepted_tokens == (snap.spec_proposed_tokens if keep_all else 0)


def test_layer_groups_drop_blocks_share_and_hit() -> None:
    """Randomized hybrid runs really give blocks back behind windows, preempt, copy on
    write and hit the prefix cache."""
    preemptions = hits = copies = dropped = appended = nulled = 0
    for seed in range(20):
        engine = simulate(seed, steps=400, hybrid=True)
        preemptions += engine.scheduler.num_preemptions
        hits += engine.scheduler.prefix_hit_tokens
        copies += engine.runner.copies
        dropped += engine.kv.num_dropped_blocks
        appended += engine.runner.appended_tables
        nulled += engine.runner.nulled_tables
    assert preemptions > 0 and hits > 0 and copies > 0 and dropped > 0 and appended > 0
    assert nulled > 0  # the runner nulled its own entries: the tables were not resent


def test_many_steps_with_preemptions_copies_and_cache_hits() -> None:
    preemptions = hits = copies = whole = appended = 0
    for seed in range(20):
        engine = simulate(seed, steps=400)
        preemptions += engine.scheduler.num_preemptions
        hits += engine.scheduler.prefix_hit_tokens
        copies += engine.runner.copies
        whole += engine.runner.whole_tables
        appended += engine.runner.appended_tables
    # The randomized runs really exercise preemption, copy-on-write and the prefix cache;
    # the runner's tables mostly come as appended ids (most often none), not whole.
    assert preemptions > 0 and hits > 0 and copies > 0
    assert appended > whole > 0


def test_requests_run_to_completion_without_aborts() -> None:
    """With no aborts, every admitted request finishes: nothing is stuck."""
    config = EngineConfig(
        block_size=4, num_kv_blocks=10, max_model_len=40, max_num_seqs=4, max_num_batched_tokens=8
    )
    engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(VOCAB, 4096), token=1))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", [i + 1] * (3 + i), params)
    finished = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        check_invariants(engine.scheduler)
    assert finished == {f"r{i}": [1] * 10 for i in range(6)}
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.allocator.num_free_blocks == 10


def test_group_readmission_never_gives_a_hit_away() -> None:
    """A preempted two-sample request comes back under memory pressure: admitting its
    first sample must not evict the cached block its second sample is about to reuse."""
    # Seven blocks, sized so that the group just fits back with no fresh block left: each
    # sample's new block must come from evicting another request's cached block.
    kv = KVCacheManager(num_blocks=7, block_size=4)
    sched = Scheduler(
        SchedulerConfig(max_model_len=24, max_num_seqs=4, max_num_batched_tokens=64), kv
    )
    s0 = Seq(sched.new_seq_id(), [1, 2, 3, 4], 4)
    req = Request("r", [s0], num_seq_slots=2)
    sched.add_request(req)
    sched.update_from_output(sched.schedule())
    s1 = Seq(sched.new_seq_id(), [1, 2, 3, 4], 4, index=1)
    sched.fork(req, s0, s1)
    s0.token_ids.append(10)
    s1.token_ids.append(20)
    for t0, t1 in [(11, 21), (12, 22), (13, 23), (14, 24)]:
        sched.update_from_output(sched.schedule())
        s0.token_ids.append(t0)
        s1.token_ids.append(t1)
    assert kv.allocate_slots(999, 8)
    kv.cache_computed_blocks(999, [7, 7, 7, 7, 8, 8, 8, 8], 8)
    sched.preempt(req)
    assert kv.allocate_slots(998, 8)  # another request takes the two uncached blocks
    kv.free(999)
    # Only cached blocks are free, s1's hit queued for eviction ahead of 999's two.
    assert all(kv.allocator.cached_info(b) is not None for b in free_block_ids(kv.allocator))
    evictions = kv.allocator.num_evictions
    sched.schedule()
    assert kv.allocator.num_evictions == evictions + 2
    assert sched.running == [req]
    for seq in (s0, s1):
        assert seq.seq_id in kv.tables  # readmitted, so what follows checks something
        for i, block in enumerate(block_table(kv, seq.seq_id).blocks):
            info = kv.allocator.cached_info(block)
            if info is not None:
                assert info.token_ids == tuple(seq.token_ids[i * 4 : (i + 1) * 4])
        assert all(kv.allocator.ref_count(b) == 1 for b in block_table(kv, seq.seq_id).blocks[1:])


def test_the_engine_over_a_fake_runner_never_imports_torch() -> None:
    """The bookkeeping path (engine, scheduler, blocks, fake runner) is plain Python."""
    code = """
import sys
sys.modules["torch"] = None  # any `import torch` now fails
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec
engine = LLMEngine(
    EngineConfig(num_kv_blocks=64), runner=FakeModelRunner(ModelSpec(100, 2048, (0,)), token=5)
)
engine.add_request("a", [1, 2, 3], SamplingParams(n=3, max_tokens=4))
engine.add_request("b", [1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=3))
while engine.has_unfinished_requests():
    engine.step()
assert engine.kv.num_free_blocks == 64
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_runner_rows_take_the_lowest_free_row_and_apply_changes_in_place() -> None:
    """The runner's copy of the tables (the fake runner's lists and the real runner's
    tensors): appended ids extend a row, whole tables replace it, gone sequences free
    their rows, and a new sequence takes the lowest free row."""

    def seq(seq_id: int, ids: tuple[int, ...], whole: bool) -> ScheduledSeq:
        return ScheduledSeq("r", seq_id, (1,), 0, (ids,), True, replaces_tables=whole)

    def step(*seqs: ScheduledSeq, finished: tuple[int, ...] = (), preempted=()) -> SchedulerOutput:
        return SchedulerOutput(seqs, {}, (), (), finished, preempted)

    store = ListTableStore(1)
    tables = BatchTables(1, store)
    batch = InputBatch(1, rows=1, entries=1)
    steps = [
        step(seq(10, (4, 5), True), seq(11, (6,), True), seq(12, (7, 8, 9), True)),
        step(seq(10, (), False), seq(11, (3,), False), seq(12, (2,), True)),
        step(seq(13, (1,), True), finished=(10,), preempted=(11,)),
        step(seq(12, (), False), seq(14, (5, 5), True), seq(13, (), False)),
    ]
    rows = [tables.apply(s) for s in steps]
    gathered = [batch.step_tables(s)[0].tolist() for s in steps]
    assert rows == [[0, 1, 2], [0, 1, 2], [0], [2, 1, 0]]
    assert gathered[1] == [[4, 5], [6, 3], [2, 0]]  # zeros past each table
    assert gathered[3] == [[2, 0], [5, 5], [1, 0]]  # row 1 was cleared for 14
    assert tables.row_of == batch.mirror.row_of == {12: 2, 13: 0, 14: 1}
    assert [runner_tables(tables, i) for i in (12, 13, 14)] == [((2,),), ((1,),), ((5, 5),)]
    with pytest.raises(RuntimeError, match="no tables of it"):
        tables.apply(step(seq(15, (1,), False)))


def test_runner_rows_apply_truncations_and_nulls_in_place() -> None:
    """An edit shortens a row (zeros past it) and nulls entries behind a window before the
    appended ids; both stores agree, and an edit longer than the row is refused."""

    def seq(seq_id: int, ids: tuple[int, ...], edit: TableEdit | None = None) -> ScheduledSeq:
        edits = (edit,) if edit is not None else ()
        return ScheduledSeq(
            "r", seq_id, (1,), 0, (ids,), True, replaces_tables=False, table_edits=edits
        )

    def step(*seqs: ScheduledSeq) -> SchedulerOutput:
        return SchedulerOutput(seqs, {}, (), ())

    null = 99
    steps = [
        step(
            ScheduledSeq("r", 1, (1,), 0, ((4, 5, 6, 7),), True),
            ScheduledSeq("r", 2, (1,), 0, ((8, 9),), True),
        ),  # whole tables
        step(seq(1, (), TableEdit(keep=2)), seq(2, (3,))),  # lookahead given back
        step(seq(1, (10,), TableEdit(2, 0, 1, null)), seq(2, ())),  # dropped, then grown
        step(seq(1, (null, 11), TableEdit(1, 1, 3, null)), seq(2, (), TableEdit(3, 0, 2, null))),
    ]
    tables = BatchTables(1, ListTableStore(1))
    batch = InputBatch(1, rows=1, entries=1)
    for s in steps:
        tables.apply(s)
    gathered = [batch.step_tables(s)[0].tolist() for s in steps]
    assert gathered[1] == [[4, 5, 0], [8, 9, 3]]  # zeros past the shortened row
    assert gathered[2] == [[null, 5, 10], [8, 9, 3]]
    assert gathered[3] == [[null, null, 11], [null, null, 3]]
    assert runner_tables(tables, 1) == runner_tables(batch.mirror, 1) == ((null, null, 11),)
    with pytest.raises(RuntimeError, match="does not fit"):
        tables.apply(step(seq(2, (), TableEdit(keep=4))))


def simulate_adapters(
    seed: int,
    steps: int = 200,
    static: bool = False,
    watch: Callable[[Scheduler], Callable[[], None]] | None = None,
) -> Scheduler:
    """The scheduler with LoRA adapters in the pool (unified pages or static slots),
    driven directly (random tokens, no runner): random arrivals under a few adapters and
    the base model, parallel samples (forks share the request's pin), aborts, drops of
    adapters (no new request under one afterwards, as the engine refuses a retired id)
    and preemptions under a tiny pool. After every step: the pool invariants above (an
    adapter's pages in no table, held once), each adapter pinned once per running request
    under it, and the runner's view: every page of an adapter a step runs was written by
    that adapter's latest load and by nothing since. At the end the pool is whole.
    `watch(scheduler)`, called once at the start, gives a check to call after every step
    and at the end (the KV events' tests)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(16, 40)
    slot_pages = rng.randint(1, 4)
    config = (
        AdapterPoolConfig("static", rng.randint(1, 3), slot_pages)
        if static
        else AdapterPoolConfig()
    )
    kv = KVCacheManager(num_blocks, block_size, adapters=config)
    ad = kv.adapters
    assert ad is not None
    sched = Scheduler(
        SchedulerConfig(
            max_model_len=num_blocks * block_size // 2,
            max_num_seqs=rng.randint(1, 6),
            max_num_batched_tokens=rng.randint(4, 32),
        ),
        kv,
    )
    lora_sizes = {i: rng.randint(1, slot_pages) for i in range(1, 5)}
    retired: set[int] = set()
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 10))] for _ in range(2)]
    max_tokens: dict[str, int] = {}
    written: dict[int, object] = {}  # the runner's pool: page -> what it last wrote there
    check = watch(sched) if watch is not None else None
    next_id = 0
    for _ in range(steps):
        if rng.random() < 0.5:
            lora = rng.choice([0, 0, *[i for i in lora_sizes if i not in retired]])
            prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 5))]
            n, new = rng.choice([1, 1, 2]), rng.randint(1, 12)
            pages = lora_sizes[lora] if lora else 0
            try:
                sched.check_fits(len(prompt), new, n, lora_pages=pages)
            except InvalidParameterError:
                pass
            else:
                rid = f"r{next_id}"
                seq = Seq(sched.new_seq_id(), prompt, len(prompt))
                sched.add_request(
                    Request(rid, [seq], n, lora_id=lora, lora_path=f"/a{lora}", lora_pages=pages)
                )
                max_tokens[rid] = len(prompt) + new
            next_id += 1
        if sched.requests and rng.random() < 0.05:
            sched.abort(rng.choice(list(sched.requests)))
        if rng.random() < 0.03:
            lora = rng.choice(list(lora_sizes))
            retired.add(lora)
            ad.drop(lora)
        out = sched.schedule()
        for load in out.lora_loads:
            assert ad.resident[load.lora_id].pages == load.pages
            for page in load.pages:
                written[page] = ("lora", load.lora_id)
        assert {s.lora_id for s in out.seqs} - {0} == set(out.lora_pages)
        for lora, pages in out.lora_pages.items():
            assert pages == ad.resident[lora].pages and ad.pins(lora) > 0
            assert all(written.get(p) == ("lora", lora) for p in pages)
        for s in out.seqs:
            assert s.lora_id == sched.requests[s.request_id].lora_id
            for block in kv.block_tables(s.seq_id)[0]:
                assert block not in adapter_pages(kv)
                written[block] = "kv"
        sched.update_from_output(out)
        for rid in out.chunk_sizes:
            req = sched.requests[rid]
            if req.num_computed_tokens < req.num_tokens:
                continue
            for seq in list(req.seqs):
                seq.token_ids.append(rng.randrange(1, VOCAB))
            if len(req.seqs) < req.num_seq_slots and not req.finished_seqs:
                parent = req.seqs[0]
                child = Seq(sched.new_seq_id(), list(parent.token_ids), parent.num_prompt_tokens)
                child.token_ids[-1] = rng.randrange(1, VOCAB)
                sched.fork(req, parent, child)
            if req.num_tokens >= max_tokens[rid] or rng.random() < 0.05:
                for seq in list(req.seqs):
                    sched.finish_seq(req, seq)
        check_invariants(sched)
        pins = Counter(r.lora_id for r in sched.running if r.lora_id)
        assert {i: a.pins for i, a in ad.resident.items() if a.pins} == dict(pins)
        if check is not None:
            check()
    for rid in list(sched.requests):
        sched.abort(rid)
    for lora in lora_sizes:
        ad.drop(lora)
    check_invariants(sched)
    if check is not None:
        check()
    assert not ad.resident and not kv.tables
    assert kv.num_free_blocks == kv.num_kv_blocks == num_blocks - config.reserved_blocks
    return sched


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=2**32), st.booleans())
def test_pool_stays_consistent_with_adapters(seed: int, static: bool) -> None:
    simulate_adapters(seed, static=static)


def test_adapter_runs_load_evict_and_preempt() -> None:
    """The randomized adapter runs really load, evict, reload and preempt."""
    loads = evictions = preemptions = 0
    for seed in range(12):
        sched = simulate_adapters(seed, steps=300, static=seed % 3 == 0)
        assert sched.kv.adapters is not None
        loads += sched.kv.adapters.num_loads
        evictions += sched.kv.adapters.num_evictions
        preemptions += sched.num_preemptions
    assert loads > evictions > 0 and preemptions > 0
