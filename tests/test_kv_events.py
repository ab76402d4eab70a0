"""KV events and snapshots against the manager's own state.

Random runs of the real engine over a fake runner (parallel sampling, best_of, beam
search, shared prefixes for cache hits, a tiny pool for preemptions, aborts): after every
step, replaying the recorded events from the pool the recording started in gives exactly
the manager's pool (reference counts, cached blocks, every table and its request), and
the snapshot agrees with the manager block by block. Nobody listening means no listener.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import json
import random
import textwrap
from collections import Counter
from typing import Any

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.kv_recorder import owners_of
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.kv_view.trace_check import check_event
from pagedllm.errors import InvalidParameterError
from pagedllm.kv.events import EVENT_FIELDS
from pagedllm.kv.pool_state import PoolState
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec
from pool_replay import pool_from_json, replay

VOCAB = 50
EOS = 0


def random_params(rng: random.Random) -> SamplingParams | BeamSearchParams:
    max_tokens = rng.randint(1, 24)
    if rng.random() < 0.2:
        return BeamSearchParams(beam_width=rng.choice([2, 3]), max_tokens=max_tokens)
    n = rng.choice([1, 1, 2, 3, 4])
    best_of = n + 1 if rng.random() < 0.1 else None
    return SamplingParams(n=n, best_of=best_of, max_tokens=max_tokens, ignore_eos=True)


def make_engine(
    rng: random.Random,
    windows: tuple[int | None, ...] | None = None,
    speculative: bool = False,
) -> LLMEngine:
    """`windows`: each layer's attention window (a model with several layer groups);
    `speculative`: n-gram proposals of 1..4 tokens (the fake model keeps some of them)."""
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(16, 48)
    spec: dict[str, Any] = {}
    if speculative:
        spec = {"speculative_method": "ngram", "num_speculative_tokens": rng.randint(1, 4)}
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": rng.randint(1, 3)}
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_model_len=num_blocks * block_size // 2,
        max_num_seqs=rng.randint(2, 10),
        max_num_batched_tokens=rng.randint(4, 48),
        **spec,
    )
    layers = len(windows) if windows else 1
    spec = ModelSpec(VOCAB, 4096, (EOS,), num_layers=layers, layer_windows=windows)
    runner = FakeModelRunner(spec, seed=rng.randrange(2**32))
    return LLMEngine(config, runner=runner)


def check_against_manager(engine: LLMEngine, state: PoolState) -> None:
    """`state` (replayed) is the manager's pool, and its JSON says what the manager says."""
    kv = engine.kv
    assert state == PoolState.of(kv, owners_of(engine.scheduler))
    snap = state.to_json()
    refs = Counter(b for t in kv.tables.values() for b in t.blocks)
    owner = owners_of(engine.scheduler)
    if kv.num_groups > 1:  # the groups' tables: the replay equalled them above
        assert [kv.allocator.ref_count(b) for b in range(kv.num_blocks)] == snap["ref"]
        assert all(snap["ref"][b] == refs.get(b, 0) for b in range(kv.num_blocks))
        return
    usage = kv.usage()
    assert sum(snap["fill"]) == usage.tokens_stored
    for block in range(kv.num_blocks):
        assert snap["ref"][block] == kv.allocator.ref_count(block) == refs.get(block, 0)
        assert snap["cached"][block] == (kv.allocator.cached_info(block) is not None)
        holders = {owner[s] for s, t in kv.tables.items() if block in t.blocks}
        assert set(snap["owners"][block]) == holders
        if refs.get(block, 0) == 0:
            assert snap["fill"][block] == 0 and not snap["owners"][block]
    for entry in snap["seqs"]:
        table = kv.tables[entry["seq"]]
        assert entry["blocks"] == table.blocks and entry["tokens"] == table.num_tokens


def check_fields(events: list[dict[str, Any]], num_blocks: int) -> None:
    """Each event passes the trace checker (what the replay page draws) and carries
    exactly the fields of kv/events.py's table for its kind: a field the recorder adds or
    drops without the checker knowing fails here."""
    for event in events:
        check_event(event, num_blocks)
        fields = set(EVENT_FIELDS[event["k"]])
        assert fields - {"req"} <= set(event) - {"k", "g"} <= fields, event


def kinds_of(events: list[dict[str, Any]]) -> list[str]:
    """Each event's kind; a `trim` that gave blocks back counts as "trim blocks" too."""
    kinds = [e["k"] for e in events]
    return kinds + ["trim blocks" for e in events if e["k"] == "trim" and e["blocks"]]


def run(
    seed: int,
    steps: int = 200,
    attach_at: int = 0,
    windows: tuple[int | None, ...] | None = None,
    speculative: bool = False,
) -> tuple[LLMEngine, Counter[str]]:
    """A random run, recorded from step `attach_at` on and checked after every step."""
    rng = random.Random(seed)
    engine = make_engine(rng, windows, speculative)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    records: list[dict[str, Any]] = []
    state: PoolState | None = None
    kinds: Counter[str] = Counter()
    next_id = 0
    for i in range(steps):
        if i == attach_at:
            recorder = engine.record_kv(records.append)
            start = recorder.snapshot()
            state = pool_from_json(start["pool"])
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
            with contextlib.suppress(InvalidParameterError):
                engine.add_request(f"r{next_id}", prompt, random_params(rng))
            next_id += 1
        if engine.scheduler.requests and rng.random() < 0.04:
            engine.abort(rng.choice(list(engine.scheduler.requests)))
        engine.step()
        if state is not None:
            for record in records:
                check_fields(record["ev"], engine.kv.num_blocks)
                replay(state, record["ev"])
                kinds.update(kinds_of(record["ev"]))
            records.clear()
            check_against_manager(engine, state)
    for request_id in list(engine.scheduler.requests):
        engine.abort(request_id)
    recorder.flush()
    assert state is not None
    for record in records:
        check_fields(record["ev"], engine.kv.num_blocks)
        replay(state, record["ev"])
        kinds.update(kinds_of(record["ev"]))
    check_against_manager(engine, state)
    assert not state.tables and not any(state.ref)
    return engine, kinds


def test_replaying_events_gives_the_managers_pool() -> None:
    kinds: Counter[str] = Counter()
    for seed in range(12):
        _, seen = run(seed)
        kinds += seen
    # The runs really show every kind of event the view draws.
    expected = {"alloc", "append", "hit", "cow", "fork", "free", "cache", "evict"}
    expected |= {"preempt", "finish", "abort"}
    assert expected <= set(kinds), kinds


def test_replaying_events_of_layer_groups() -> None:
    """Sliding-window groups: events carry their group, and blocks given back behind a
    window replay as `drop`."""
    kinds: Counter[str] = Counter()
    for seed in range(8):
        _, seen = run(seed, windows=(5, 5, None, 5, 5, None), attach_at=seed * 5)
        kinds += seen
    assert {"alloc", "hit", "cow", "fork", "free", "drop", "preempt"} <= set(kinds), kinds


def test_replaying_events_of_speculative_runs() -> None:
    """n-gram speculation claims lookahead slots for its proposals and gives back those
    of the rejected ones as `trim` events: replaying them follows the pool exactly,
    blocks given back included, with layer groups too."""
    kinds: Counter[str] = Counter()
    for seed in range(8):
        windows = (5, None, 5) if seed % 2 else None
        _, seen = run(seed, windows=windows, speculative=True, attach_at=seed * 3)
        kinds += seen
    assert {"alloc", "append", "trim", "trim blocks", "free", "cache"} <= set(kinds), kinds


def test_every_event_kind_passes_the_trace_checker() -> None:
    """Runs with everything at once (parallel samples and beams with their copies on
    write, preemptions, n-gram speculation's trims, a sliding-window group's drops): every
    event the recorder emits has exactly the fields the trace checker's table names (each
    run checks every record), and the runs show every kind a run can emit."""
    kinds: Counter[str] = Counter()
    for seed in range(8):
        _, seen = run(seed, windows=(5, None, 5), speculative=True)
        kinds += seen
    # Not here: the text mode, a cache reset, and adapters' pages (tests/test_adapter_events.py).
    expected = set(EVENT_FIELDS) - {"text", "reset", "lora_load", "lora_evict"}
    assert expected <= set(kinds), expected - set(kinds)


def test_trim_events_of_a_scripted_check() -> None:
    """Exact events of proposals rejected, then kept: the lookahead slots claimed as an
    `alloc`, the rejected ones' blocks back as a `trim`, and the prefix cache hashing
    kept tokens only."""
    keep = {1: 0, 2: 2}  # the row's output tokens so far -> proposals kept
    config = EngineConfig(
        block_size=2,
        num_kv_blocks=16,
        speculative_method="ngram",
        num_speculative_tokens=3,
        prompt_lookup_min=1,
        prompt_lookup_max=1,
    )
    runner = FakeModelRunner(
        ModelSpec(VOCAB, 4096), token=7, num_accepted=lambda row: keep.get(row.num_output_tokens, 0)
    )
    engine = LLMEngine(config, runner=runner)
    records: list[dict[str, Any]] = []
    recorder = engine.record_kv(records.append)
    state = pool_from_json(recorder.snapshot()["pool"])
    engine.add_request("a", [7, 8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    seq = {"seq": 0, "req": "a"}
    assert [r["ev"] for r in records] == [
        [{"k": "alloc", **seq, "blocks": [0, 1], "tokens": 3}, {"k": "cache", "block": 0}],
        # Proposals 8 9 7 (what followed the first 7) claim slots 4..6 in two fresh
        # blocks; none is kept: the table claims 4 slots again and both blocks go back.
        # Block 1 (9 and the model's 7) is cached only after the trim.
        [
            {"k": "alloc", **seq, "blocks": [2, 3], "tokens": 7},
            {"k": "trim", **seq, "tokens": 4, "blocks": [2, 3], "la": 3},
            {"k": "cache", "block": 1},
        ],
        # Proposal 7 (what followed the latest 7) is kept: nothing goes back.
        [
            {"k": "alloc", **seq, "blocks": [2], "tokens": 6},
            {"k": "trim", **seq, "tokens": 6, "blocks": [], "la": 1},
            {"k": "cache", "block": 2},
        ],
        # Rejected, but its slot shares a block with the model's token: the block stays.
        [
            {"k": "alloc", **seq, "blocks": [3], "tokens": 8},
            {"k": "trim", **seq, "tokens": 7, "blocks": [], "la": 1},
        ],
        # No room left under max_tokens: no proposal, a plain step.
        [
            {"k": "append", **seq, "tokens": 8},
            {"k": "cache", "block": 3},
            {"k": "free", **seq, "blocks": [0, 1, 2, 3]},
            {"k": "finish", "req": "a"},
        ],
    ]
    for record in records:
        replay(state, record["ev"])
    assert state == PoolState.of(engine.kv) and not any(state.ref)


def test_recording_can_start_mid_run() -> None:
    """A view that connects late starts from a snapshot; the events after it add up."""
    for seed in range(4):
        run(seed, steps=160, attach_at=60)


def test_records_are_numbered_by_step_and_carry_figures() -> None:
    engine = make_engine(random.Random(3))
    records: list[dict[str, Any]] = []
    engine.record_kv(records.append)
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(n=3, max_tokens=5, ignore_eos=True))
    engine.add_request("b", [1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    steps = [r["step"] for r in records]
    assert steps == list(range(1, len(steps) + 1))
    assert records[-1]["st"]["used"] == engine.kv.allocator.num_used_blocks
    assert records[-1]["st"]["run"] == 0 and records[-1]["st"]["wait"] == 0
    finished = [e["req"] for r in records for e in r["ev"] if e["k"] == "finish"]
    assert sorted(finished) == ["a", "b"]
    forks = [e for r in records for e in r["ev"] if e["k"] == "fork"]
    assert {e["req"] for e in forks} == {"a", "b"}
    json.dumps(records)  # plain JSON, ready for a trace or the wire


def test_preempt_note_comes_before_the_frees_it_caused() -> None:
    config = EngineConfig(
        block_size=4, num_kv_blocks=10, max_model_len=40, max_num_seqs=4, max_num_batched_tokens=8
    )
    engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(VOCAB, 4096), token=1))
    records: list[dict[str, Any]] = []
    engine.record_kv(records.append)
    for i in range(6):
        engine.add_request(
            f"r{i}", [i + 1] * (3 + i), SamplingParams(max_tokens=10, ignore_eos=True)
        )
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    for record in records:
        for i, event in enumerate(record["ev"]):
            if event["k"] == "preempt":
                assert record["ev"][i + 1]["k"] == "free"
                assert record["ev"][i + 1]["req"] == event["req"]


def test_nobody_listening_means_no_listener() -> None:
    engine = make_engine(random.Random(5))
    assert engine.kv.listener is None and engine.kv.allocator.listener is None
    records: list[dict[str, Any]] = []
    recorder = engine.record_kv(records.append)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    recorder.close()
    assert engine.kv.listener is None and engine.kv.allocator.listener is None
    count = len(records)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(records) == count


class WordTokenizer:
    """Decodes token i as the word `w<i>`."""

    eos_token_id = None

    def decode(self, ids: list[int], **_: Any) -> str:
        return " ".join(f"w{i}" for i in ids)


def test_text_only_when_asked() -> None:
    def record(text: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        engine = make_engine(random.Random(7))
        records: list[dict[str, Any]] = []
        recorder = engine.record_kv(records.append, text=text, tokenizer=WordTokenizer())
        engine.add_request("a", list(range(1, 10)), SamplingParams(n=2, max_tokens=4))
        for _ in range(3):
            engine.step()
        return records, recorder.snapshot()

    records, snap = record(text=False)
    assert "text" not in snap and "text" not in json.dumps(records)
    records, snap = record(text=True)
    texts = [e for r in records for e in r["ev"] if e["k"] == "text"]
    assert texts and all(e["text"].startswith("w") for e in texts)
    first_block = snap["pool"]["seqs"][0]["blocks"][0]
    assert snap["text"][str(first_block)].startswith("w1 w2")


def test_snapshot_lists_requests_and_figures() -> None:
    engine = make_engine(random.Random(11))
    engine.add_request("a", [1, 2, 3, 4], SamplingParams(n=2, max_tokens=6, ignore_eos=True))
    engine.add_request("b", [5, 6], BeamSearchParams(beam_width=2, max_tokens=6))
    engine.step()
    engine.step()
    snap = engine.kv_snapshot()
    assert snap["step"] == 2
    requests = {r["id"]: r for r in snap["requests"]}
    assert requests["a"]["width"] == 2 and not requests["a"]["beam"]
    assert requests["b"]["beam"] and requests["b"]["width"] == 2
    assert snap["st"]["used"] == engine.kv.allocator.num_used_blocks
    seqs = {s["seq"]: s for s in snap["pool"]["seqs"]}
    assert {seqs[s]["req"] for s in requests["a"]["seqs"]} == {"a"}
    json.dumps(snap)


def test_the_python_replay_reads_the_event_table() -> None:
    """PoolState.apply reads no field of an event that its kind's row in kv/events.py's
    table lacks, and replays every kind that changes the pool."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(PoolState.apply)))
    replayed = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if not (isinstance(test, ast.Compare) and getattr(test.left, "id", "") == "kind"):
            continue
        kind = test.comparators[0].value  # `kind == "alloc"`
        replayed.add(kind)
        used = {
            sub.slice.value
            for branch in node.body
            for sub in ast.walk(branch)
            if isinstance(sub, ast.Subscript) and getattr(sub.value, "id", "") == "event"
        }
        used |= {
            call.args[0].value
            for branch in node.body
            for call in ast.walk(branch)
            if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "get"
        }
        assert used <= set(EVENT_FIELDS[kind]), (kind, used)
    notes = {"preempt", "finish", "abort", "text"}  # they change no block
    assert replayed == set(EVENT_FIELDS) - notes
