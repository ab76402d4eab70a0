"""Helpers for the server tests: a real uvicorn server on a free loopback port over a tiny
random Llama that carries SmolLM2's tokenizer, its metrics, and OpenAI error checks.

Each test module's `chat_model_dir` fixture calls `build_chat_model`, which builds the
model once per session."""

from __future__ import annotations

import re
import threading
import time
import typing
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel

from hf_oracle import make_tiny_model
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.server.app import create_app
from pagedllm.loader import LoadedModel, ModelLoadError, default_model_path

# The exact path, as the oracle tests compare (tiny Hugging Face directories take it
# anyway).
OPTIONS: dict[str, Any] = dict(num_kv_blocks=256, block_size=16, quantization="none")
NAME = "tiny"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


_built: dict[str, Path] = {}


def smollm2_tokenizer() -> Any:
    """SmolLM2's real tokenizer and chat template, from the packaged model (the test is
    skipped without it)."""
    try:
        gguf = default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    from pagedllm.loader.tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(gguf, None)


def build_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template (built once)."""
    if "chat" in _built:
        return _built["chat"]
    tokenizer = smollm2_tokenizer()
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-chat"), "llama", vocab_size=49152)
    tokenizer.save_pretrained(path)
    _built["chat"] = path
    return path


class LiveServer:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.engine = app.state.engine
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "the server failed to start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        return {m[1]: float(m[2]) for m in re.finditer(r"^(pagedllm:\S+) (\S+)$", text, re.M)}

    def rejected(self, status: int) -> float:
        return self.metrics().get(f'pagedllm:request_rejected_total{{status="{status}"}}', 0)

    def wait_metrics(self, **expected: float) -> dict[str, float]:
        """Poll /metrics until the named values hold (the engine updates them per step)."""
        deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
        while time.monotonic() < deadline:
            values = self.metrics()
            if all(values.get(f"pagedllm:{k}") == v for k, v in expected.items()):
                return values
            time.sleep(0.01)
        raise AssertionError(f"metrics never reached {expected}: {self.metrics()}")

    def assert_pool_whole(self) -> None:
        """Every request has ended and every KV block is back in the pool; no 500."""
        values = self.wait_metrics(kv_blocks_used=0, num_requests_running=0, num_requests_waiting=0)
        assert values["pagedllm:kv_blocks_free"] == values["pagedllm:kv_blocks_total"]
        kv = self.engine.engine.kv
        assert kv.num_free_blocks == kv.num_blocks
        assert self.rejected(500) == 0

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def start_server(
    model_dir: Path | str,
    engine_options: dict[str, Any] | None = None,
    loaded: LoadedModel | None = None,
    **app: Any,
):
    """A LiveServer over a fresh engine, built on its loop thread as `pagedllm serve`
    builds it (over `loaded`, the model already loaded from `model_dir`, if given); `app`
    goes to create_app."""
    config = EngineConfig(model=str(model_dir), **{**OPTIONS, **(engine_options or {})})
    engine = AsyncLLMEngine.build(lambda: LLMEngine(config, loaded))
    return LiveServer(create_app(engine, served_model_name=NAME, **app))


def check_error(
    r: httpx.Response,
    status: int,
    *,
    param: str | None = None,
    code: str | None = None,
    words: tuple[str, ...] = (),
) -> dict[str, Any]:
    """An OpenAI error object with this status and param (and code, when given)."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text and error["param"] == param, error
    assert code is None or error["code"] == code, error
    assert all(w in error["message"] for w in words), error["message"]
    return error


def post_raw(url: str, body: str | bytes) -> httpx.Response:
    """POST a body exactly as given (e.g. JSON that Python's json module would not write)."""
    return httpx.post(url, content=body, headers={"content-type": "application/json"})


def event_models() -> dict[str, type[BaseModel]]:
    """The openai package's model of each Responses API stream event, by its `type`."""
    union = typing.get_args(ResponseStreamEvent)[0]
    models = typing.get_args(union)
    return {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in models}
