"""The KV view in a real browser (headless Chromium over the DevTools protocol): the live
page of a busy server (1,456 blocks, 100+ running requests) draws every block, and a
replay file of a beam search draws its forks and copies, and one of n-gram speculation
marks its lookahead slots. All run under their
Content-Security-Policy, which stops any other script; data that looks like markup stays
text. Screenshots go to the test's
temporary folder, or to $KV_VIEW_SCREENSHOTS when set. Skipped where Chromium is absent
(`make chromium` installs it)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from browser import Browser, chromium_path
from kv_demo import busy_server, freeze_when_busy, record_beam_search, start_load
from live_server import build_chat_model
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.kv_recorder import KVRecorder
from pagedllm.engine.kv_trace import FORMAT, VERSION, KVTrace
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.snapshot import take_snapshot
from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.kv_view.page import render
from pagedllm.entrypoints.kv_view.trace_check import check_trace
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec
from test_scheduler_property import simulate_adapters

pytestmark = pytest.mark.skipif(
    chromium_path() is None,
    reason="Chromium is not installed: `make chromium` installs Debian's chromium package",
)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    pytest.importorskip("websockets", reason="the DevTools client needs `websockets` (dev extra)")
    with Browser(width=1500, height=1100) as b:
        yield b


# An inline script added to the page: the policy must stop it.
INJECTED_SCRIPT_RUNS = (
    "(() => { const s = document.createElement('script');"
    " s.textContent = 'window.__injected = 1'; document.body.append(s);"
    " return window.__injected === 1; })()"
)


def shots_dir(tmp_path: Path) -> Path:
    folder = os.environ.get("KV_VIEW_SCREENSHOTS")
    return Path(folder) if folder else tmp_path


def test_live_page_draws_a_busy_pool(browser: Browser, tmp_path: Path) -> None:
    live = busy_server(api_key="s3cret")
    try:
        # The key rides in the URL's fragment, which never reaches the server; the page
        # keeps it in sessionStorage and gets a stream token with it.
        browser.goto(live.url + "/kv#key=s3cret")
        browser.wait_for("document.body.dataset.drawnBlocks === '1456'", "the empty pool")
        load = start_load(live, count=300)
        freeze_when_busy(live, running=100)
        recorder = live.engine.engine.kv.listener
        assert isinstance(recorder, KVRecorder)  # the page's stream attached it
        step = recorder.step
        browser.wait_for(f"document.body.dataset.step === '{step}'", f"step {step}")
        browser.wait_for("document.body.dataset.tableArrows > 0", "a block table")
        data = browser.evaluate("JSON.parse(JSON.stringify(document.body.dataset))")
        kv = live.engine.engine.kv
        assert int(data["drawnBlocks"]) == kv.num_blocks == 1456
        assert int(data["usedBlocks"]) == kv.allocator.num_used_blocks > 1000
        counts = json.loads(data["counts"])
        assert counts["fork"] > 0 and counts["cow"] > 0 and counts["alloc"] > 0
        assert "API key" not in browser.evaluate("document.getElementById('status').textContent")
        assert browser.evaluate(INJECTED_SCRIPT_RUNS) is False
        browser.screenshot(shots_dir(tmp_path) / "kv-view-live.png")
    finally:
        browser.goto("about:blank")  # an open stream would hold the server's shutdown up
        live.close()  # the requests still running fail, and the load's thread ends
    load.join(60)
    assert not load.is_alive()


def test_live_page_asks_for_the_key(browser: Browser) -> None:
    live = busy_server(num_blocks=64, api_key="s3cret")
    try:
        browser.goto(live.url + "/kv#key=wrong")
        browser.wait_for("!document.getElementById('keybox').hidden", "the key prompt")
        assert browser.evaluate("document.body.dataset.drawnBlocks") is None
        # Typed into the prompt, the right key opens the view.
        browser.evaluate("document.getElementById('keyinput').value = 's3cret'")
        browser.evaluate("document.getElementById('keyform').requestSubmit()")
        browser.wait_for("document.body.dataset.drawnBlocks === '64'", "the pool")
        assert browser.evaluate("document.getElementById('keybox').hidden")
    finally:
        browser.goto("about:blank")
        live.close()


def test_replay_of_a_beam_search_shows_forks_and_copies(
    browser: Browser, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    trace_path = tmp_path / "beam.json"
    model = os.environ.get("KV_VIEW_BEAM_MODEL")  # the screenshots use the default model
    if model is None:
        model = str(build_chat_model(tmp_path_factory))
    record_beam_search(trace_path, None if model == "default" else model)
    html = tmp_path / "beam.html"
    assert main(["kv-view", str(trace_path), "-o", str(html)]) == 0
    browser.goto(html.as_uri())
    browser.wait_for("document.body.dataset.tableArrows > 0", "the beams' block tables")
    data = browser.evaluate("JSON.parse(JSON.stringify(document.body.dataset))")
    assert data["mode"] == "replay" and data["drawnBlocks"] == "48"
    counts = json.loads(data["counts"])
    assert counts["fork"] > 0 and counts["cow"] > 0
    # Four beams share their first blocks: more arrows than physical blocks.
    assert int(data["tableArrows"]) > int(data["usedBlocks"])
    assert browser.evaluate(INJECTED_SCRIPT_RUNS) is False
    browser.screenshot(shots_dir(tmp_path) / "kv-view-beam-replay.png")
    # The slider goes back to the start: an empty pool.
    browser.evaluate(
        "const s = document.getElementById('slider'); s.value = 0;"
        "s.dispatchEvent(new Event('input'))"
    )
    browser.wait_for("document.body.dataset.usedBlocks === '0'", "the empty pool at step 0")


def test_markup_in_a_trace_stays_text(browser: Browser, tmp_path: Path) -> None:
    """`pagedllm kv-view` refuses such a trace; the page, given one anyway, draws it as
    text: no element is made from it and nothing in it runs."""
    mark = "<img src=x onerror=window.__xss=1>"
    pool = {
        "num_blocks": 4,
        "block_size": 4,
        "ref": [0] * 4,
        "cached": [0] * 4,
        "fill": [0] * 4,
        "owners": [[] for _ in range(4)],
        "seqs": [],
    }
    st = {"used": mark, "cached": 0, "tokens": 3, "util": 0.1, "shared": 0, "run": mark}
    st.update(wait=0, seqs=1, pre=mark)
    trace = {
        "format": "pagedllm-kv-trace",
        "version": 1,
        "meta": {"command": mark},
        "start": {"step": 0, "pool": pool, "requests": [], "st": {**st, "used": 0}},
        "records": [
            {
                "step": 1,
                "ev": [{"k": "alloc", "seq": 0, "req": mark, "blocks": [1], "tokens": 3}],
                "st": st,
            }
        ],
    }
    page = tmp_path / "crafted.html"
    page.write_text(render("replay", trace), encoding="utf-8")
    browser.goto(page.as_uri())
    browser.wait_for("document.body.dataset.step === '1'", "the crafted step")
    made = "document.querySelectorAll('img, [onerror]').length"
    assert browser.evaluate(made) == 0
    assert browser.evaluate("window.__xss") is None
    stats = browser.evaluate("document.getElementById('stats').textContent")
    assert mark in stats
    assert browser.evaluate("document.querySelector('#reqlist .id').title") == mark
    assert mark in browser.evaluate("document.getElementById('chartlegend').textContent")


def test_replay_of_speculation_marks_lookahead_slots(browser: Browser, tmp_path: Path) -> None:
    """A bookkeeping run with n-gram speculation: at a step whose check gave blocks back,
    the page marks the lookahead slots (blocks given back among them), logs the `trim`,
    and ends with the pool the manager ended with."""
    config = EngineConfig(
        block_size=2,
        num_kv_blocks=64,
        speculative_method="ngram",
        num_speculative_tokens=4,
        prompt_lookup_min=1,
    )
    engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(50, 4096), seed=3))
    trace = KVTrace.record(engine, command="n-gram speculation over the fake runner")
    for i in range(6):
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        engine.add_request(f"r{i}", [1 + i, 2, 3, 1 + i, 2, 3], params)
    while engine.has_unfinished_requests():
        engine.step()
    path = tmp_path / "spec.json"
    records = trace.write(path)["records"]
    given = [r for r in records if any(e["k"] == "trim" and e["blocks"] for e in r["ev"])]
    assert given, "no check gave a block back"
    html = tmp_path / "spec.html"
    assert main(["kv-view", str(path), "-o", str(html)]) == 0
    browser.goto(html.as_uri() + f"#step={given[0]['step']}")
    browser.wait_for("document.body.dataset.givenBlocks > 0", "the blocks given back")
    data = browser.evaluate("JSON.parse(JSON.stringify(document.body.dataset))")
    assert int(data["lookaheadBlocks"]) >= int(data["givenBlocks"])
    assert json.loads(data["counts"])["trim"] > 0
    log = browser.evaluate("document.getElementById('log').textContent")
    assert "gave back [" in log
    browser.screenshot(shots_dir(tmp_path) / "kv-view-speculation.png")
    browser.evaluate(
        "const s = document.getElementById('slider'); s.value = s.max;"
        "s.dispatchEvent(new Event('input'))"
    )
    browser.wait_for("document.body.dataset.usedBlocks === '0'", "the empty pool at the end")


@pytest.mark.parametrize("static", [False, True])
def test_replay_draws_adapter_pages(browser: Browser, tmp_path: Path, static: bool) -> None:
    """A scheduler run with LoRA adapters in the pool (tests/test_scheduler_property.py's),
    recorded step by step: at a step after a load the page draws the adapters' pages (and
    a static pool's slots) apart from KV blocks and logs the load; at the end only the
    static slots' pages are left."""
    records: list[dict[str, Any]] = []
    start: dict[str, Any] = {}

    def watch(sched: Scheduler) -> Callable[[], None]:
        kv = sched.kv
        recorder = KVRecorder(sched, kv, records.append, lambda: take_snapshot(sched, kv, 0))
        kv.set_listener(recorder)
        start.update(recorder.snapshot())
        return lambda: recorder.on_step_begin(recorder.step + 1)  # publishes the step

    sched = simulate_adapters(3, steps=120, static=static, watch=watch)
    assert sched.kv.adapters is not None
    reserved = sched.kv.adapters.config.reserved_blocks
    trace = {"format": FORMAT, "version": VERSION, "meta": {}, "start": start, "records": records}
    check_trace(trace)
    loaded = next(r for r in records if any(e["k"] == "lora_load" for e in r["ev"]))
    html = tmp_path / "lora.html"
    html.write_text(render("replay", trace), encoding="utf-8")
    browser.goto(html.as_uri() + f"#step={loaded['step']}")
    browser.wait_for(f"document.body.dataset.step === '{loaded['step']}'", "the load's step")
    data = browser.evaluate("JSON.parse(JSON.stringify(document.body.dataset))")
    assert int(data["adapterBlocks"]) > 0
    assert json.loads(data["counts"])["lora_load"] > 0
    assert "adapter " in browser.evaluate("document.getElementById('log').textContent")
    mode = "static" if static else "unified"
    browser.screenshot(shots_dir(tmp_path) / f"kv-view-lora-{mode}.png")
    browser.evaluate(
        "const s = document.getElementById('slider'); s.value = s.max;"
        "s.dispatchEvent(new Event('input'))"
    )
    browser.wait_for(
        f"document.body.dataset.adapterBlocks === '{reserved}'", "only static slots at the end"
    )
