"""LoRA adapters over HTTP, end to end: `pagedllm serve --enable-lora --lora-modules ...
--enable-lora-loading --lora-dir ...` in a subprocess over a tiny random Llama (SmolLM2's
tokenizer), driven by the official `openai` client. Each adapter's greedy tokens are
transformers + PEFT's; `model` picks the adapter on every endpoint; adapters load and
unload at run time inside the LoRA directory only; a bad adapter stops the server."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import pagedllm
from hf_oracle import hf_greedy, load_hf, load_hf_lora, make_lora_adapter
from live_server import CHAT, build_chat_model, check_error, start_server
from pagedllm.entrypoints.server.lora_modules import LoRAModule

NAME = "tiny"
MAX_RANK = 8
PROMPT = [504, 3301, 281, 253, 1751, 28, 3287, 29]
N = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: Path, port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "serve",
        str(model),
        "--served-model-name",
        NAME,
        "--port",
        str(port),
        "--num-kv-blocks",
        "256",
        "--block-size",
        "16",
        "--quantization",
        "none",
        "--no-kv-view",
        "--log-level",
        "warning",
        "--enable-lora",
        "--max-lora-rank",
        str(MAX_RANK),
        *flags,
    ]


ENV = {**os.environ, "PYTHONPATH": str(Path(pagedllm.__file__).parents[1])}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory)


@pytest.fixture(scope="module")
def loras(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters: a and b served from the start (outside the LoRA directory), c, `wide`
    (rank past the server's limit) and `broken` (a malformed config) in it, and `secret`
    outside it."""
    root = tmp_path_factory.mktemp("loras")
    (root / "dir").mkdir()
    made = {
        "a": make_lora_adapter(model, root / "a", seed=1, r=4, targets=("q_proj", "v_proj")),
        "b": make_lora_adapter(
            model, root / "b", seed=2, r=8, targets=("o_proj", "gate_proj", "down_proj")
        ),
        "c": make_lora_adapter(
            model, root / "dir" / "c", seed=3, r=2, targets=("k_proj", "up_proj"), rslora=True
        ),
        "wide": make_lora_adapter(model, root / "dir" / "wide", seed=4, r=2 * MAX_RANK),
        "secret": make_lora_adapter(model, root / "secret", seed=5),
    }
    (root / "dir" / "escape").symlink_to(made["secret"])
    (root / "dir" / "broken").mkdir()
    (root / "dir" / "broken" / "adapter_config.json").write_text('{"r": 4, ')
    return made


@pytest.fixture(scope="module")
def oracle(model: Path, loras: dict[str, Path]) -> Any:
    """transformers (+ PEFT under an adapter): greedy token ids, EOS ignored."""
    hf: dict[str | None, Any] = {}

    def greedy(name: str | None, prompt: list[int], n: int) -> list[int]:
        if name not in hf:
            hf[name] = load_hf(model) if name is None else load_hf_lora(model, loras[name])
        return hf_greedy(hf[name], prompt, n)

    return greedy


@pytest.fixture(scope="module")
def server(model: Path, loras: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("serve-log") / "serve.log"
    log = log_path.open("w")
    modules = ["a=" + str(loras["a"]), f'{{"name": "b", "path": "{loras["b"]}"}}']
    cmd = serve_command(
        model,
        port,
        "--lora-modules",
        *modules,
        "--enable-lora-loading",
        "--lora-dir",
        str(loras["c"].parent),
    )
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    try:
        deadline = time.monotonic() + 300  # a hang guard for the start, not a timing
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
        assert "Traceback" not in log_path.read_text(), log_path.read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@functools.cache
def tokenizer() -> Any:
    from live_server import smollm2_tokenizer

    return smollm2_tokenizer()


def pieces(ids: list[int]) -> list[str]:
    tok = tokenizer()
    return [tok.decode([t]) for t in ids]


def complete(url: str, model: str, prompt: list[int] = PROMPT, n: int = N) -> Any:
    return client(url).completions.create(
        model=model,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )


def load(url: str, name: str, path: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=120
    )


def unload(url: str, name: str) -> httpx.Response:
    return httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=120)


def test_models_lists_the_base_and_each_adapter(server: str, model: Path, loras) -> None:
    cards = {m.id: m for m in client(server).models.list().data}
    assert list(cards) == [NAME, "a", "b"]
    assert cards[NAME].model_extra["parent"] is None
    assert cards[NAME].model_extra["root"] == str(model)
    for name in ("a", "b"):
        assert cards[name].model_extra["parent"] == NAME
        assert cards[name].model_extra["root"] == str(loras[name])
    one = httpx.get(server + "/v1/models/b").json()
    assert one["id"] == "b" and one["parent"] == NAME


def test_each_adapter_gives_transformers_peft_tokens(server: str, oracle) -> None:
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        results[name] = complete(server, name)

    # Sent together: the engine's steps mix rows of both adapters and of the base.
    threads = [threading.Thread(target=run, args=(m,)) for m in (NAME, "a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    want = {m: oracle(None if m == NAME else m, PROMPT, N) for m in (NAME, "a", "b")}
    assert len({tuple(w) for w in want.values()}) == 3  # each adapter changes the tokens
    for m in (NAME, "a", "b"):
        assert results[m].model == m
        assert results[m].choices[0].logprobs.tokens == pieces(want[m]), m


def test_chat_and_responses_pick_the_adapter(server: str, oracle) -> None:
    ids = httpx.post(server + "/tokenize", json={"model": "a", "messages": CHAT}).json()["tokens"]
    chat = client(server).chat.completions.create(
        model="a", messages=CHAT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.model == "a"
    assert chat.choices[0].message.content == tokenizer().decode(
        oracle("a", ids, N), skip_special_tokens=True
    )
    under_b = client(server).chat.completions.create(
        model="b", messages=CHAT, max_tokens=N, temperature=0
    )
    response = client(server).responses.create(
        model="b", input=CHAT, max_output_tokens=N, temperature=0
    )
    assert response.model == "b"
    assert response.output_text == under_b.choices[0].message.content


def test_unknown_models_are_404_on_every_endpoint(server: str) -> None:
    c = client(server)
    calls = [
        lambda: c.completions.create(model="nope", prompt=PROMPT, max_tokens=1),
        lambda: c.chat.completions.create(model="nope", messages=CHAT, max_tokens=1),
        lambda: c.responses.create(model="nope", input="hi", max_output_tokens=1),
        lambda: c.models.retrieve("nope"),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["code"] == "model_not_found", info.value.body
        assert info.value.body["param"] == "model"


def test_load_checks_path_rank_and_name(server: str, loras) -> None:
    outside = str(loras["secret"])
    for path in (outside, "../secret", "escape", str(loras["c"].parent / ".." / "secret")):
        check_error(load(server, "x", path), 400, param="lora_path")
    # The engine's check names the field it refused.
    check_error(load(server, "x", "wide"), 400, param="max_lora_rank")
    check_error(load(server, "x", "broken"), 400, param="lora_path", words=("broken",))
    check_error(load(server, "a", "c"), 400, param="lora_name", words=("already",))
    check_error(load(server, NAME, "c"), 400, param="lora_name")
    missing = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "x"})
    check_error(missing, 400, param="lora_path")
    names = [m.id for m in client(server).models.list().data]
    assert names == [NAME, "a", "b"]  # nothing refused was served


def test_load_use_unload_and_load_again(server: str, loras, oracle) -> None:
    r = load(server, "c", str(loras["c"]))  # absolute, inside the directory
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully."
    cards = {m.id: m for m in client(server).models.list().data}
    assert cards["c"].model_extra["parent"] == NAME
    want = pieces(oracle("c", PROMPT, N))
    assert complete(server, "c").choices[0].logprobs.tokens == want
    r = unload(server, "c")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' removed successfully."
    with pytest.raises(openai.NotFoundError):
        complete(server, "c")
    check_error(unload(server, "c"), 404, param="lora_name")
    check_error(unload(server, "never"), 404, param="lora_name")
    assert load(server, "c", "c").status_code == 200  # relative to the directory; a new id
    assert complete(server, "c").choices[0].logprobs.tokens == want
    assert unload(server, "c").status_code == 200


def test_unloading_lets_running_requests_finish(server: str, oracle) -> None:
    n = 96
    want = pieces(oracle("a", PROMPT, n))
    stream = client(server).completions.create(
        model="a",
        prompt=PROMPT,
        max_tokens=n,
        temperature=0,
        logprobs=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got: list[str] = []
    for chunk in stream:
        if not got:  # the request runs: unload its adapter under it
            assert unload(server, "a").status_code == 200
        got += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
    assert got == want
    with pytest.raises(openai.NotFoundError):
        complete(server, "a")
    assert [m.id for m in client(server).models.list().data] == [NAME, "b"]


def test_a_bad_adapter_stops_the_server_at_start(model: Path, loras) -> None:
    cmd = serve_command(model, free_port(), "--lora-modules", f"wide={loras['wide']}")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 2, done.stderr
    assert "pagedllm serve: error:" in done.stderr
    assert "rank 16, above max_lora_rank 8" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture
def in_process(model: Path, loras) -> Iterator[Any]:
    server = start_server(
        model,
        {"enable_lora": True, "max_lora_rank": MAX_RANK},
        lora_modules=[LoRAModule("a", str(loras["a"]))],
    )
    yield server
    server.close()


def test_without_loading_the_routes_are_absent(in_process, oracle) -> None:
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        check_error(httpx.post(in_process.url + path, json={"lora_name": "a"}), 404)
    out = complete(in_process.url, "a")
    assert out.choices[0].logprobs.tokens == pieces(oracle("a", PROMPT, N))
    in_process.wait_metrics(num_requests_running=0, num_requests_waiting=0)
    kv = in_process.engine.engine.kv
    # Every KV block is back; the adapter stays resident (unpinned) in its pages.
    held = kv.adapters.held_blocks()
    assert held > 0 and kv.num_free_blocks + held == kv.num_blocks
    assert in_process.rejected(500) == 0


def test_ray_replicas_serve_the_lora_modules(model: Path, loras, oracle) -> None:
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from pagedllm.engine.config import EngineConfig
    from pagedllm.entrypoints.ray_serve.app import RayServeOptions, build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = EngineConfig(
            model=str(model),
            num_kv_blocks=256,
            block_size=16,
            enable_lora=True,
            max_lora_rank=MAX_RANK,
            quantization="none",
        )
        app = build_app(
            config,
            RayServeOptions(num_replicas=1, routing="pow2"),
            served_model_name=NAME,
            lora_modules=(LoRAModule("a", str(loras["a"])),),
        )
        serve.run(app, name="pagedllm", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        assert [m.id for m in client(url).models.list().data] == [NAME, "a"]
        out = complete(url, "a")
        assert out.model == "a"
        assert out.choices[0].logprobs.tokens == pieces(oracle("a", PROMPT, N))
        with pytest.raises(openai.NotFoundError):
            complete(url, "b")
        check_error(httpx.post(url + "/v1/load_lora_adapter", json={}), 404)
    finally:
        serve.shutdown()
        ray.shutdown()
