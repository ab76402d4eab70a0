"""The KV view of a real server (uvicorn on a loopback port, engine over a fake runner):
/kv/snapshot, the /kv/events stream read by a real client (replaying it rebuilds the
pool), a disconnect that detaches the recorder, a reader that stops reading while the
engine runs thousands of steps (bounded memory, then one coalesced snapshot), the API key
on every /kv route, token text only when asked for, and --no-kv-view."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from inspect_internals import recorder_attached, retained_records
from live_server import LiveServer, check_error, start_server
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.server.app import create_app
from pagedllm.entrypoints.server.kv_routes import StreamTokens
from pagedllm.kv.pool_state import PoolState
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec
from pool_replay import pool_from_json, replay

KEY = {"Authorization": "Bearer s3cret"}


def fake_server(num_blocks: int = 64, **app: Any) -> LiveServer:
    config = EngineConfig(
        num_kv_blocks=num_blocks, block_size=4, max_num_seqs=16, max_num_batched_tokens=64
    )
    engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(100, 4096, (0,)), seed=1))
    return LiveServer(create_app(engine, served_model_name="fake", **app))


@pytest.fixture
def server() -> Iterator[LiveServer]:
    live = fake_server(kv_view_interval=0.05)
    yield live
    live.close()


def drive(live: LiveServer, requests: list[tuple[str, list[int], Any]]) -> None:
    """Run requests on the server's engine to the end (from this thread's own loop)."""

    async def main() -> None:
        streams = [await live.engine.add_request(*r) for r in requests]
        for stream in streams:
            async for _ in stream:
                pass

    asyncio.run(main())


def workload(count: int, tag: str = "r") -> list[tuple[str, list[int], Any]]:
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15]  # a common prefix: cache hits
    requests: list[tuple[str, list[int], Any]] = []
    for i in range(count):
        prompt = shared + [20 + i % 50] * (1 + i % 5)
        params: Any = (
            BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
            if i % 4 == 3
            else SamplingParams(n=1 + i % 3, max_tokens=4 + i % 7, ignore_eos=True)
        )
        requests.append((f"{tag}{i}", prompt, params))
    return requests


def sse_messages(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event, data) of each Server-Sent Event; comments are skipped."""
    kind, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield kind, json.loads("\n".join(data))
            kind, data = "message", []
        elif line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def follow(
    first: dict[str, Any], messages: Iterator[tuple[str, dict[str, Any]]], until_step: int
) -> tuple[PoolState, set[str]]:
    """From the `first` snapshot, apply a stream's messages until it reaches `until_step`;
    the pool and the kinds of event seen."""
    state = pool_from_json(first["pool"])
    kinds: set[str] = set()
    step = first["step"]
    for kind, data in messages:
        if kind == "snapshot":
            state = pool_from_json(data["pool"])
            step = data["step"]
        elif kind == "update":
            for record in data["records"]:
                assert record["step"] >= step
                replay(state, record["ev"])
                kinds.update(e["k"] for e in record["ev"])
                step = record["step"]
        if step >= until_step:
            return state, kinds
    raise AssertionError("the stream ended early")


def test_snapshot_json(server: LiveServer) -> None:
    drive(server, workload(6))
    snap = httpx.get(server.url + "/kv/snapshot").json()
    pool = snap["pool"]
    assert pool["num_blocks"] == 64 and pool["block_size"] == 4
    assert not pool["seqs"] and not any(pool["ref"])
    assert sum(pool["cached"]) > 0  # full prompt blocks stay cached after their requests
    assert snap["st"]["used"] == 0 and snap["st"]["run"] == 0
    assert "text" not in snap


def test_events_stream_rebuilds_the_pool(server: LiveServer) -> None:
    with httpx.stream("GET", server.url + "/kv/events", timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        messages = sse_messages(r.iter_lines())
        kind, first = next(messages)
        assert kind == "snapshot" and first["pool"]["num_blocks"] == 64
        feed = server.app.state.kv_feed
        assert feed.subscribers == 1
        wait_until(lambda: recorder_attached(feed), "the recorder is attached")
        thread = threading.Thread(target=drive, args=(server, workload(12)))
        thread.start()
        thread.join()
        final = httpx.get(server.url + "/kv/snapshot").json()
        state, kinds = follow(first, messages, final["step"])
    assert state == pool_from_json(final["pool"])
    assert {"alloc", "fork", "cow", "hit", "free", "finish"} <= kinds


def test_a_disconnect_frees_the_listener(server: LiveServer) -> None:
    engine = server.engine.engine
    feed = server.app.state.kv_feed
    assert engine.kv.listener is None
    for _ in range(2):  # a second viewer attaches again after the first one left
        with httpx.stream("GET", server.url + "/kv/events", timeout=60) as r:
            messages = sse_messages(r.iter_lines())  # kept: closing it closes the stream
            next(messages)
            wait_until(lambda: engine.kv.listener is not None, "the recorder is attached")
            drive(server, workload(3))
        wait_until(lambda: feed.subscribers == 0, "the subscriber is gone")
        wait_until(lambda: engine.kv.listener is None, "the recorder is detached")
        assert engine.kv.listener is None and engine.kv.allocator.listener is None
        assert retained_records(feed) == 0


def test_a_stalled_reader_costs_bounded_memory() -> None:
    live = fake_server(num_blocks=512, kv_view_interval=0.01)
    feed = live.app.state.kv_feed
    feed.max_records = 64
    # Small socket buffers on both ends: the stream backs up after a few kilobytes.
    for sock in live.server.servers[0].sockets:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        client.connect(("127.0.0.1", live.port))
        client.sendall(b"GET /kv/events HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: recorder_attached(feed), "the recorder is attached")
        drive(live, workload(40, "warm"))
        tracemalloc.start()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for batch in range(3):  # many steps, while the client reads nothing
            drive(live, workload(80, f"b{batch}"))
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert retained_records(feed) <= 64
        assert grown < 4 * 2**20, f"memory grew by {grown} bytes"
        steps = live.engine.snapshot.num_steps
        assert steps > 4 * feed.max_records, steps
        # The reader wakes up: it gets one snapshot of now, not a backlog of every step.
        client.settimeout(60)
        kinds = []
        with client.makefile("rb") as reader:  # open, it would keep the socket open
            while reader.readline().strip():  # the response head
                pass
            lines = (line.decode().rstrip("\r\n") for line in reader)
            for kind, data in sse_messages(lines):
                kinds.append(kind)
                if kind == "snapshot" and data["step"] >= steps:
                    break
        assert kinds[0] == "snapshot" and kinds.count("snapshot") >= 2
        assert len(kinds) < 200  # coalesced, far fewer messages than steps
    finally:
        client.close()
        live.close()


def test_the_view_needs_the_key() -> None:
    live = fake_server(api_key="s3cret")
    try:
        url = live.url
        for bad in ({}, {"Authorization": "Bearer nope"}):
            check_error(httpx.get(url + "/kv/snapshot", headers=bad), 401, code="invalid_api_key")
            check_error(httpx.post(url + "/kv/token", headers=bad), 401, code="invalid_api_key")
            check_error(httpx.get(url + "/kv/events", headers=bad), 401, code="invalid_api_key")
            page = httpx.get(url + "/kv", headers=bad)
            assert page.status_code == 401 and "API key" in page.text
        assert httpx.get(url + "/kv", headers=KEY).status_code == 200
        assert httpx.get(url + "/kv/snapshot", headers=KEY).json()["pool"]["num_blocks"] == 64
        token = httpx.post(url + "/kv/token", headers=KEY).json()["token"]
        check_error(httpx.get(url + "/kv/events", params={"token": token + "x"}), 401)
        check_error(httpx.get(url + "/kv/events", params={"token": "1.abc"}), 401)
        for how in ({"params": {"token": token}}, {"headers": KEY}):
            with httpx.stream("GET", url + "/kv/events", timeout=60, **how) as r:
                assert r.status_code == 200
                assert next(sse_messages(r.iter_lines()))[0] == "snapshot"
    finally:
        live.close()


def test_stream_tokens_expire() -> None:
    now = [1000.0]
    tokens = StreamTokens(ttl=60, clock=lambda: now[0])
    token = tokens.issue()
    assert tokens.valid(token)
    now[0] += 61
    assert not tokens.valid(token)
    other = StreamTokens(ttl=60, clock=lambda: now[0])  # another server's secret
    assert not other.valid(tokens.issue())


def test_no_kv_view() -> None:
    live = fake_server(kv_view=False)
    try:
        for path in ("/kv", "/kv/snapshot", "/kv/events"):
            assert httpx.get(live.url + path).status_code == 404
        assert httpx.post(live.url + "/kv/token").status_code == 404
        assert live.engine.engine.kv.listener is None
    finally:
        live.close()


@pytest.mark.parametrize("text", [False, True])
def test_token_text_only_with_kv_view_text(chat_model_dir: Path, text: bool) -> None:
    live = start_server(chat_model_dir, kv_view_text=text)
    try:
        with httpx.stream("GET", live.url + "/kv/events", timeout=60) as r:
            messages = sse_messages(r.iter_lines())
            next(messages)
            feed = live.app.state.kv_feed
            wait_until(lambda: recorder_attached(feed), "the recorder is attached")
            client = live.client()
            # Two prompts that share no prefix, so their blocks are fresh and get text.
            client.completions.create(model="tiny", prompt="Hello there, friend", max_tokens=3)
            body = json.dumps(httpx.get(live.url + "/kv/snapshot").json())
            seen = []
            finished = False
            for kind, data in messages:
                seen.append(json.dumps(data))
                if kind == "update" and any(
                    e["k"] == "finish" for rec in data["records"] for e in rec["ev"]
                ):
                    finished = True
                    break
        # Else the stream ended first, and the checks below would hold of any stream.
        assert finished, "no finish event in the stream"
        stream_text = "".join(seen)
        if text:
            assert '"k":"text"' in stream_text.replace(" ", "") and "Hello" in stream_text
        else:
            assert '"text"' not in stream_text and "Hello" not in stream_text
            assert '"text"' not in body
    finally:
        live.close()


def test_serve_flags(monkeypatch: pytest.MonkeyPatch, chat_model_dir: Path) -> None:
    from pagedllm.entrypoints.server import shutdown
    from pagedllm.entrypoints.server.serve_cli import add_serve_parser

    served: list[Any] = []
    monkeypatch.setattr(shutdown, "serve", lambda app, timeout, **kw: served.append(app))
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    base = ["serve", "--model", str(chat_model_dir), "--num-kv-blocks", "32"]
    for flags, routes in (([], True), (["--no-kv-view"], False), (["--kv-view-text"], True)):
        args = parser.parse_args([*base, *flags])
        assert args.func(args) == 0
        app = served[-1]
        assert hasattr(app.state, "kv_feed") == routes
        if routes:
            assert app.state.kv_feed.text == ("--kv-view-text" in flags)
