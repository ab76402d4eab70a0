"""What the server offers beyond one prompt in, one answer out: batch prompts (prompt i's
choices are i*n .. i*n+n-1, usage summed, all aborted together), logit_bias, tokenization
off the engine thread, and the HTTP surface (HEAD, /v1/models/{id}, docs behind a switch
and the key, CORS for browsers). After every test on the shared server the pool is whole."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from inspect_internals import pause, resume
from live_server import (
    CHAT,
    NAME,
    LiveServer,
    check_error,
    start_server,
)
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def pool_stays_whole(server: LiveServer) -> Iterator[None]:
    yield
    server.assert_pool_whole()


def texts(offline: LLM, prompts: list[Any], params: SamplingParams) -> list[str]:
    """Every choice's text, prompt after prompt (the server's choice order)."""
    return [c.text for o in offline.generate(prompts, params, use_tqdm=False) for c in o.outputs]


# ------------------------------------------------------------------ batch prompts
def test_batch_prompts_give_one_choice_per_prompt_in_order(
    server: LiveServer, offline: LLM
) -> None:
    client = server.client()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    for prompts in (["Hello", "World"], [[1, 504, 3458], [282, 4649]]):
        out = client.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0)
        assert [c.index for c in out.choices] == [0, 1]
        assert [c.text for c in out.choices] == texts(offline, prompts, greedy)
        prompt_tokens = sum(
            len(o.prompt_token_ids) for o in offline.generate(prompts, greedy, use_tqdm=False)
        )
        assert out.usage.prompt_tokens == prompt_tokens
        assert out.usage.completion_tokens == 16


def test_batch_prompts_with_n_number_choices_as_vllm_does(server: LiveServer, offline: LLM) -> None:
    client = server.client()
    prompts = ["Once upon a time", "The weather today"]
    seeded = dict(n=2, temperature=0.9, seed=7, max_tokens=6)
    want = texts(offline, prompts, SamplingParams(**seeded))  # prompt 0: 0, 1; prompt 1: 2, 3
    out = client.completions.create(model=NAME, prompt=prompts, **seeded)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == want
    got = {i: "" for i in range(4)}
    stream = client.completions.create(
        model=NAME, prompt=prompts, stream=True, stream_options={"include_usage": True}, **seeded
    )
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            got[choice.index] += choice.text
    assert list(got.values()) == want
    assert chunks[-1].usage.completion_tokens == 4 * 6
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_a_client_leaving_a_batch_aborts_every_prompt(server: LiveServer) -> None:
    aborted = server.metrics().get('pagedllm:request_finished_total{finished_reason="abort"}', 0)
    body = {
        "model": NAME,
        "prompt": ["Tell me a long story", "Tell me another one"],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            next(lines), next(lines)
            pause(server.engine)  # neither can finish on its own now
            assert server.metrics()["pagedllm:kv_blocks_used"] > 0
        server.wait_metrics(kv_blocks_used=0, num_requests_running=0, num_requests_waiting=0)
    finally:
        resume(server.engine)
    after = server.metrics()['pagedllm:request_finished_total{finished_reason="abort"}']
    assert after == aborted + 2


# ------------------------------------------------------------------ cached tokens
def test_usage_reports_the_prompt_tokens_served_by_the_prefix_cache(server: LiveServer) -> None:
    """`usage.prompt_tokens_details.cached_tokens`, as OpenAI's client reads it: the full
    blocks (16 tokens) of a repeated prompt, all but the block holding its last token."""
    client = server.client()
    prompt = list(range(7000, 7070))  # 70 tokens no other test sends: 4 full blocks + 6
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    assert again.choices[0].text == first.choices[0].text
    # A batch sums its prompts' cached tokens: 64 again, and 0 for a new prompt.
    batch = [prompt, list(range(7100, 7120))]
    out = client.completions.create(model=NAME, prompt=batch, max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens == 64
    stream = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert list(stream)[-1].usage.prompt_tokens_details.cached_tokens == 64

    # Chat: the templated prompt's full blocks, but for the one with its last token.
    messages = [{"role": "user", "content": "Tell me everything about paged attention. " * 6}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    cached = (chat.usage.prompt_tokens - 1) // 16 * 16
    again_chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert again_chat.usage.prompt_tokens_details.cached_tokens == cached > 32
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    raw = httpx.post(
        server.url + "/v1/completions",
        json={"model": NAME, "prompt": prompt, "max_tokens": 1},
    ).json()
    assert raw["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}


# ------------------------------------------------------------------ logit_bias
def test_logit_bias_steers_sampling_like_the_offline_api(server: LiveServer, offline: LLM) -> None:
    client = server.client()
    bias = {504: 100.0}  # token 504 whatever the logits say
    want = texts(offline, ["Hello"], SamplingParams(temperature=0, max_tokens=4, logit_bias=bias))
    out = client.completions.create(
        model=NAME, prompt="Hello", max_tokens=4, temperature=0, logit_bias={"504": 100}
    )
    assert [out.choices[0].text] == want
    assert want[0] == offline.get_tokenizer().decode([504] * 4)
    chat = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=4, temperature=0, logit_bias={"504": 100}
    )
    assert chat.choices[0].message.content == want[0]


# ------------------------------------------------------------------ tokenization
def test_the_engine_thread_gets_token_ids_and_never_tokenizes(
    server: LiveServer, monkeypatch
) -> None:
    engine = server.engine.engine
    prompts: list[Any] = []
    encode_threads: list[str] = []
    add_request, encode = engine.add_request, engine.tokenizer.encode

    def recording_add(request_id: str, prompt: Any, *args: Any, **kw: Any) -> None:
        prompts.append(prompt)
        add_request(request_id, prompt, *args, **kw)

    def recording_encode(*args: Any, **kw: Any) -> Any:
        encode_threads.append(threading.current_thread().name)
        return encode(*args, **kw)

    monkeypatch.setattr(engine, "add_request", recording_add)
    monkeypatch.setattr(engine.tokenizer, "encode", recording_encode)
    client = server.client()
    client.completions.create(model=NAME, prompt="Hello there", max_tokens=2)
    client.completions.create(model=NAME, prompt=["a", "b"], max_tokens=2)
    client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2)
    assert len(prompts) == 4
    assert all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts)
    assert encode_threads and all(t.startswith("pagedllm-tokenizer") for t in encode_threads)


# ------------------------------------------------------------------ the HTTP surface
def test_head_model_lookup_and_docs_off_by_default(server: LiveServer) -> None:
    for path in ("/health", "/v1/models", f"/v1/models/{NAME}"):
        r = httpx.head(server.url + path)
        assert r.status_code == 200 and r.content == b"", path
        # The same headers as GET: the JSON type and the length of the body GET sends.
        get = httpx.get(server.url + path)
        assert get.status_code == 200 and get.content, path
        assert r.headers["content-type"] == get.headers["content-type"] == "application/json"
        assert r.headers["content-length"] == str(len(get.content)), path
    model = server.client().models.retrieve(NAME)
    assert model.id == NAME and model.object == "model"
    check_error(
        httpx.get(server.url + "/v1/models/gpt-4"), 404, param="model", code="model_not_found"
    )
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 404, path
    preflight = httpx.options(
        server.url + "/v1/completions",
        headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers  # CORS is off by default


def test_docs_behind_the_key_and_cors_for_allowed_origins(chat_model_dir: Path) -> None:
    live = start_server(
        chat_model_dir,
        api_key="s3cret",
        enable_docs=True,
        allowed_origins=["http://app.example"],
    )
    key = {"Authorization": "Bearer s3cret"}
    try:
        for path in ("/docs", "/redoc", "/openapi.json"):
            r = httpx.get(live.url + path)
            check_error(r, 401, code="invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
            assert httpx.get(live.url + path, headers=key).status_code == 200, path
        assert (
            "/v1/chat/completions"
            in httpx.get(live.url + "/openapi.json", headers=key).json()["paths"]
        )
        ask = {
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        }
        preflight = httpx.options(
            live.url + "/v1/completions", headers={"Origin": "http://app.example", **ask}
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.options(
            live.url + "/v1/completions", headers={"Origin": "http://evil.example", **ask}
        )
        assert "access-control-allow-origin" not in other.headers
        r = httpx.post(
            live.url + "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 2},
            headers={"Origin": "http://app.example", **key},
        )
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        live.assert_pool_whole()
    finally:
        live.close()
