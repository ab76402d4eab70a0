"""Graceful shutdown with a limit (`pagedllm serve --shutdown-timeout`, shutdown.py).

A real `pagedllm serve` process gets SIGTERM while three streams and one non-streaming
request run, each asking for far more tokens than it could make before the test's bound:
new connections are refused at once, each stream ends with an error event then
`data: [DONE]`, the other request gets a 503, and the process exits within the limit plus
a margin (without the limit it served every stream to its end). In process: the same
shutdown leaves the KV pool whole, and a request that reaches the app while it drains is
refused with 503. Bad limits are refused before a model loads (test_cli.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

import pagedllm
from hf_oracle import make_tiny_model
from live_server import NAME, check_error
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.server.app import create_app
from pagedllm.entrypoints.server.shutdown import DrainingServer
from pagedllm.loader import ModelLoadError, default_model_path

LIMIT_S = 1.0
# The limit, the close grace, and the interpreter's exit, generously: the requests below
# would run for minutes.
EXIT_BOUND_S = 15.0
LONG = 30_000  # tokens asked of each request: minutes of decoding, even for a tiny model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and room for LONG tokens."""
    try:
        gguf = default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    from pagedllm.loader.tokenizer import load_gguf_tokenizer

    path = tmp_path_factory.mktemp("tiny-long")
    make_tiny_model(path, "llama", vocab_size=49152, max_position_embeddings=LONG + 64)
    load_gguf_tokenizer(gguf, None).save_pretrained(path)
    return path


def body(stream: bool) -> dict[str, Any]:
    return {"model": NAME, "prompt": "Hi", "max_tokens": LONG, "ignore_eos": True, "stream": stream}


class Stream(threading.Thread):
    """One streaming completion, its `data:` payloads kept; `started` once the first
    chunk came."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.started = threading.Event()
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=body(True), timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        self.started.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.started.set()


class Whole(threading.Thread):
    """One non-streaming completion and its response."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.response: httpx.Response | None = None

    def run(self) -> None:
        self.response = httpx.post(self.url, json=body(False), timeout=120)


def assert_ended_by_the_shutdown(streams: list[Stream], whole: Whole) -> None:
    for s in streams:
        assert s.error is None, s.error
        assert s.events[-1] == "[DONE]", s.events[-3:]
        error = json.loads(s.events[-2])["error"]
        assert error["code"] == "server_shutting_down", error
        assert "shutting down" in error["message"]
        assert all("error" not in json.loads(e) for e in s.events[:-2])  # tokens before it
    assert whole.response is not None
    check_error(whole.response, 503, code="server_shutting_down", words=("shutting down",))


def test_sigterm_ends_running_requests_at_the_limit_and_exits(
    long_context_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    # The test's own interpreter and source tree.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "serve",
            "--model",
            str(long_context_model_dir),
            "--served-model-name",
            NAME,
            "--port",
            str(port),
            "--shutdown-timeout",
            str(LIMIT_S),
            "--num-kv-blocks",
            str(4 * (LONG // 16 + 8)),
            "--no-kv-view",
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(Path(pagedllm.__file__).parents[1])},
    )
    try:
        deadline = time.monotonic() + 180  # a hang guard for the start, not a timing
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        streams = [Stream(url + "/v1/completions") for _ in range(3)]
        whole = Whole(url + "/v1/completions")
        for t in (*streams, whole):
            t.start()
        for s in streams:
            assert s.started.wait(120)
        running = 0.0
        while running < 4:  # the non-streaming one too
            assert time.monotonic() < deadline, "the requests did not start"
            metrics = httpx.get(url + "/metrics", timeout=120).text  # not httpx's 5 s
            running = float(metrics.split("\npagedllm:num_requests_running ")[1].split()[0])

        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        refused = False
        while not refused and proc.poll() is None:
            assert time.monotonic() - signalled < EXIT_BOUND_S, "new connections still accepted"
            try:
                httpx.get(url + "/health", timeout=1)
            except httpx.ConnectError:
                refused = True
            except httpx.TransportError:
                # Caught by the close: still in the listener's backlog when it closed, or
                # accepted and closed unread (reset, ReadError), or closed after it was read
                # (RemoteProtocolError), or not answered in time. The server promised to
                # refuse new connections, not to answer one that raced the close: ask again.
                pass
        # Refused while the streams still ran: the limit had not passed.
        assert refused and not any(s.events and s.events[-1] == "[DONE]" for s in streams)
        # Uvicorn raises the signal again once it has shut down: killed by SIGTERM.
        assert proc.wait(timeout=EXIT_BOUND_S) == -signal.SIGTERM
        assert time.monotonic() - signalled < EXIT_BOUND_S
        for t in (*streams, whole):
            t.join(10)
        assert_ended_by_the_shutdown(streams, whole)
        # Ended by the engine at the limit, not cut by uvicorn's later cancellation.
        assert "timeout graceful shutdown exceeded" not in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_the_shutdown_frees_every_block_and_refuses_new_requests(
    long_context_model_dir: Path,
) -> None:
    config = EngineConfig(
        model=str(long_context_model_dir), num_kv_blocks=4 * (LONG // 16 + 8), block_size=16
    )
    engine = AsyncLLMEngine.build(lambda: LLMEngine(config))
    app = create_app(engine, served_model_name=NAME, kv_view=False)
    server = DrainingServer(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"), engine, LIMIT_S
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server failed to start"
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/completions"
    streams = [Stream(url) for _ in range(2)]
    whole = Whole(url)
    for t in (*streams, whole):
        t.start()
    for s in streams:
        assert s.started.wait(120)
    deadline = time.monotonic() + 120  # a hang guard, not a timing
    while engine.snapshot.num_running < 3:  # the non-streaming one too
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.01)
    assert engine.snapshot.usage.used_blocks > 0

    engine.drain()  # as the shutdown does first: a request read from now on is refused
    # The file's 120 s, not httpx's 5 s: the app's loop shares this process with the
    # engine and the streams' readers, and a loaded machine may answer slowly.
    refused = httpx.post(url, json=body(False), timeout=120)
    check_error(refused, 503, code="server_shutting_down")
    server.should_exit = True  # what SIGTERM does
    thread.join(60)  # without the limit, it would wait for the streams' minutes
    assert not thread.is_alive()
    for t in (*streams, whole):
        t.join(10)
    assert_ended_by_the_shutdown(streams, whole)
    kv = engine.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
