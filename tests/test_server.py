"""The OpenAI-compatible server, run for real (uvicorn on a free loopback port) over a tiny
random Llama that carries SmolLM2's tokenizer: the official `openai` client gets the same
text as the offline `LLM`, every error has its status and OpenAI error body, 32 concurrent
streams are all correct, and nothing leaks (a client that hangs up frees its blocks)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inspect_internals import pause, resume
from live_server import (
    CHAT,
    NAME,
    OPTIONS,
    LiveServer,
    check_error,
    post_raw,
    start_server,
)
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams


def greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def offline_text(offline: LLM, prompt: Any, params: SamplingParams) -> list[str]:
    return [c.text for c in offline.generate(prompt, params, use_tqdm=False)[0].outputs]


# ------------------------------------------------------------------ the happy path
def test_completion_and_chat_equal_offline(server: LiveServer, offline: LLM) -> None:
    client = server.client()
    out = client.completions.create(
        model=NAME, prompt="The capital of France is", max_tokens=16, temperature=0
    )
    assert [out.choices[0].text] == offline_text(offline, "The capital of France is", greedy())
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 16
    ids = [1, 504, 3458, 282, 4649]
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert [out.choices[0].text] == offline_text(offline, ids, greedy(8))
    assert out.usage.prompt_tokens == 5
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0)
    want = offline.chat(CHAT, greedy(12), use_tqdm=False)[0]
    assert chat.choices[0].message.content == want.outputs[0].text
    assert chat.usage.prompt_tokens == len(want.prompt_token_ids)
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_streaming_n_and_stop(server: LiveServer, offline: LLM) -> None:
    client = server.client()
    prompt = "Once upon a time"
    full = offline_text(offline, prompt, greedy(24))[0]
    stop = full[len(full) // 2 :][:4]  # a stop string that the greedy text contains
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stop=[stop],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline_text(offline, prompt, greedy(24, stop=stop))[0]
    assert full.startswith(text) and stop not in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0

    seeded = dict(temperature=0.9, seed=1234, max_tokens=10, n=2)
    want = offline.chat(CHAT, SamplingParams(**seeded), use_tqdm=False)[0]
    got = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model=NAME, messages=CHAT, stream=True, **seeded):
        for choice in chunk.choices:
            got[choice.index] += choice.delta.content or ""
    assert [got[0], got[1]] == [c.text for c in want.outputs]
    plain = client.chat.completions.create(model=NAME, messages=CHAT, **seeded)
    assert [c.message.content for c in plain.choices] == [got[0], got[1]]


def test_logprobs(server: LiveServer) -> None:
    client = server.client()
    out = client.completions.create(
        model=NAME, prompt="Hello", max_tokens=4, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(
        len(top) == 3 and max(top.values()) == t
        for top, t in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )  # greedy: the best one
    chat = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


def test_32_concurrent_streams_are_correct_and_leak_nothing(
    server: LiveServer, offline: LLM
) -> None:
    prompts = [f"Request {i}: tell me about topic number {i * 7}" for i in range(32)]
    want = [o.outputs[0].text for o in offline.generate(prompts, greedy(20), use_tqdm=False)]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    async def one(prompt: str) -> str:
        stream = await client.completions.create(
            model=NAME, prompt=prompt, max_tokens=20, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(main()) == want
    values = server.wait_metrics(kv_blocks_used=0, num_requests_running=0, num_requests_waiting=0)
    assert values["pagedllm:kv_blocks_total"] == OPTIONS["num_kv_blocks"]
    assert values["pagedllm:generation_tokens_total"] >= 32 * 20
    assert values["pagedllm:time_to_first_token_seconds_count"] >= 32


def test_client_disconnect_aborts_and_frees_blocks(server: LiveServer) -> None:
    aborted = server.metrics().get('pagedllm:request_finished_total{finished_reason="abort"}', 0)
    closed = server.rejected(499)
    body = {
        "model": NAME,
        "prompt": "Tell me a long story",
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            next(lines), next(lines)
            pause(server.engine)  # the request now cannot finish on its own
            assert server.metrics()["pagedllm:kv_blocks_used"] > 0
        server.wait_metrics(kv_blocks_used=0, num_requests_running=0)
        # A non-streaming request whose client gives up (once the request is queued) is
        # aborted as well.
        payload = json.dumps({**body, "stream": False}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            server.wait_metrics(num_requests_waiting=1)
        server.wait_metrics(kv_blocks_used=0, num_requests_waiting=0)
    finally:
        resume(server.engine)
    values = server.metrics()
    assert values['pagedllm:request_finished_total{finished_reason="abort"}'] == aborted + 2
    # The non-streaming one is a client disconnect (499), not a server error.
    assert server.rejected(499) == closed + 1
    server.assert_pool_whole()


# ------------------------------------------------------------------------ errors
def test_bad_requests_get_openai_errors(server: LiveServer) -> None:
    url = server.url + "/v1/completions"

    def post(body: Any, path: str = url) -> httpx.Response:
        if isinstance(body, (str, bytes)):
            return post_raw(path, body)
        return httpx.post(path, json=body)

    check_error(post('{"prompt": "x",'), 400, words=("JSON",))
    check_error(
        post({"prompt": "x", "max_tokens": "ten"}), 400, param="max_tokens", words=("max_tokens",)
    )
    check_error(
        post({"prompt": "x", "stream_options": {"include_usage": "yes"}}),
        400,
        param="stream_options",
        words=("stream_options.include_usage",),
    )
    check_error(
        post({"messages": "hi"}, server.url + "/v1/chat/completions"), 400, param="messages"
    )
    check_error(post({"max_tokens": 3}), 400, param="prompt", words=("prompt",))
    check_error(
        post({"prompt": "x", "temperature": -1}),
        400,
        param="temperature",
        words=("temperature must be in [0, inf)",),
    )
    check_error(post({"prompt": "x", "top_p": 1.5}), 400, param="top_p")
    # The prompt leaves room for fewer tokens: max_tokens is what to change.
    check_error(
        post({"prompt": [5] * 500, "max_tokens": 100}),
        400,
        param="max_tokens",
        code="context_length_exceeded",
        words=("500", "100", "512"),
    )
    check_error(
        post({"prompt": [5] * 600, "max_tokens": 1}),
        400,
        param="prompt",
        code="context_length_exceeded",
    )
    check_error(post({"model": "gpt-4", "prompt": "x"}), 404, param="model", words=("gpt-4",))
    check_error(post({"prompt": "x" * (1 << 20)}), 413, words=("1048576",))
    chunked = httpx.post(url, content=(b"x" * 65536 for _ in range(32)))  # no Content-Length
    check_error(chunked, 413)
    check_error(httpx.get(server.url + "/v1/nothing"), 404)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().completions.create(model=NAME, prompt="x", temperature=-1)


def test_overload_gets_503_with_retry_after(chat_model_dir: Path) -> None:
    # One sequence slot: one waiting request can be admitted, the next is the backlog.
    live = start_server(chat_model_dir, {"max_num_seqs": 1}, max_waiting=1)
    engine = live.engine
    pause(engine)
    url = live.url + "/v1/completions"
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    try:
        with (
            httpx.stream("POST", url, json={**body, "stream": True}) as first,
            httpx.stream("POST", url, json={**body, "stream": True}) as second,
        ):
            assert (first.status_code, second.status_code) == (200, 200)
            r = httpx.post(url, json=body)
            check_error(r, 503, code="server_overloaded", words=("max_waiting=1",))
            assert r.headers["retry-after"] == "1"
            resume(engine)
            for stream in (first, second):
                assert [line for line in stream.iter_lines() if line][-1] == "data: [DONE]"
        assert httpx.post(url, json=body).status_code == 200
        live.assert_pool_whole()
    finally:
        resume(engine)
        live.close()


def test_every_prompt_of_a_batch_counts_against_max_waiting(chat_model_dir: Path) -> None:
    """300 prompts in one request, max_waiting=8 and 4 sequence slots: refused whole with
    a 503, as single requests are, never admitted in part; a batch that fits is taken."""
    live = start_server(
        chat_model_dir, {"max_num_seqs": 4}, max_waiting=8, max_prompts_per_request=1000
    )
    engine = live.engine
    pause(engine)
    url = live.url + "/v1/completions"
    body = {"model": NAME, "max_tokens": 2, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url, json={**body, "prompt": ["Hello"] * 300}) as r:
            assert r.status_code == 503, "a batch of 300 was admitted"
            r.read()
            check_error(r, 503, code="server_overloaded", words=("max_waiting=8",))
        assert live.metrics()["pagedllm:num_requests_waiting"] == 0  # none of it stayed
        # 4 admissible + 8 beyond: exactly the limit. One more prompt is one too many.
        with httpx.stream("POST", url, json={**body, "prompt": ["Hello"] * 12}) as fits:
            assert fits.status_code == 200
            live.wait_metrics(num_requests_waiting=12, num_requests_backlog=8)
            for extra in (["Hello"], "Hello"):
                r = httpx.post(url, json={**body, "prompt": extra})
                check_error(r, 503, code="server_overloaded")
            assert live.metrics()["pagedllm:num_requests_waiting"] == 12
            resume(engine)
            assert [line for line in fits.iter_lines() if line][-1] == "data: [DONE]"
        live.assert_pool_whole()
    finally:
        resume(engine)
        live.close()


def test_a_batch_past_the_prompt_limit_is_a_400_naming_prompt(server: LiveServer) -> None:
    body = {"model": NAME, "prompt": [[1, 2]] * 257, "max_tokens": 1, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 400, "a batch of 257 prompts was taken"
        r.read()
        check_error(r, 400, param="prompt", words=("257", "at most 256"))
    body["prompt"] = [[1, 2]] * 256
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
    server.assert_pool_whole()


def test_max_waiting_lets_an_idle_server_take_a_burst_it_has_room_for(
    server: LiveServer,
) -> None:
    """20 simultaneous requests, max_waiting=4, 128 free sequence slots: all are served."""
    engine = server.engine
    engine.max_waiting = 4
    pause(engine)  # all 20 wait together
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0}

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            tasks = [
                asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(20)
            ]
            await asyncio.to_thread(server.wait_metrics, num_requests_waiting=20)
            resume(engine)
            return [r.status_code for r in await asyncio.gather(*tasks)]

    try:
        assert asyncio.run(main()) == [200] * 20
    finally:
        engine.max_waiting = None
        resume(engine)
    server.assert_pool_whole()


def test_api_key(chat_model_dir: Path) -> None:
    live = start_server(chat_model_dir, api_key="s3cret")
    try:
        url = live.url + "/v1/completions"
        body = {"prompt": "Hi", "max_tokens": 2}
        r = httpx.post(url, json=body)
        check_error(r, 401, code="invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
        check_error(httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}), 401)
        check_error(httpx.post(url, json=body, headers={"Authorization": "Bearer"}), 401)
        check_error(httpx.get(live.url + "/v1/models"), 401)
        check_error(httpx.get(live.url + f"/v1/models/{NAME}"), 401)
        with pytest.raises(openai.AuthenticationError):
            live.client("wrong").completions.create(model=NAME, prompt="Hi", max_tokens=2)
        out = live.client("s3cret").completions.create(model=NAME, prompt="Hi", max_tokens=2)
        assert out.usage.completion_tokens == 2
        assert httpx.get(live.url + "/health").status_code == 200  # no key needed
    finally:
        live.close()


def test_an_empty_api_key_means_no_key(chat_model_dir: Path, monkeypatch, caplog) -> None:
    live = start_server(chat_model_dir, api_key="")
    try:
        url = live.url + "/v1/completions"
        body = {"prompt": "Hi", "max_tokens": 2}
        assert httpx.post(url, json=body).status_code == 200
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer"}).status_code == 200
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer x"}).status_code == 200
    finally:
        live.close()
    # `pagedllm serve` with PAGEDLLM_API_KEY="" says the same.
    from pagedllm.entrypoints.server import shutdown
    from pagedllm.entrypoints.server.serve_cli import add_serve_parser

    served = []
    monkeypatch.setattr(shutdown, "serve", lambda app, timeout, **kw: served.append(app))
    monkeypatch.setenv("PAGEDLLM_API_KEY", "")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", str(chat_model_dir), "--num-kv-blocks", "32"])
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert args.func(args) == 0
    assert len(served) == 1
    assert "API key not required" in caplog.text and "empty" in caplog.text
