"""The tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) against the model's own
Hugging Face tokenizer, behind the API key, with their errors; lm-evaluation-harness's
remote tokenizer over them; several served model names; and finish_reason "length" for a
request that used all of max_tokens, streamed or not. One server over the chat model (a
tiny random Llama with SmolLM2's tokenizer and chat template), served under two names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from live_server import CHAT, NAME, OPTIONS, LiveServer, check_error
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.server.app import create_app

KEY = "k3y"
ALIAS = "tiny-alias"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def keyed(chat_model_dir: Path) -> Iterator[LiveServer]:
    config = EngineConfig(model=str(chat_model_dir), **OPTIONS)
    engine = AsyncLLMEngine.build(lambda: LLMEngine(config))
    live = LiveServer(create_app(engine, served_model_name=[NAME, ALIAS], api_key=KEY))
    yield live
    live.close()


@pytest.fixture(scope="module")
def hf_tokenizer(chat_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model_dir)


def post(server: LiveServer, path: str, body: Any, headers: dict[str, str] = AUTH):
    return httpx.post(server.url + path, json=body, headers=headers)


def raw(server: LiveServer, path: str, body: str) -> httpx.Response:
    """POST a body exactly as given."""
    headers = {**AUTH, "content-type": "application/json"}
    return httpx.post(server.url + path, content=body, headers=headers)


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], generation: bool = True, **kw: Any):
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation, **kw
    )
    return tokenizer.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------- /tokenize
def test_tokenize_a_prompt(keyed: LiveServer, hf_tokenizer: Any) -> None:
    text = "The capital of France is Paris. <|im_end|> ünïcödé"
    want = hf_tokenizer.encode(text, add_special_tokens=True)
    r = post(keyed, "/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    max_len = keyed.engine.max_model_len
    assert r.json() == {
        "count": len(want),
        "max_model_len": max_len,
        "tokens": want,
        "token_strs": None,
    }
    r = post(keyed, "/tokenize", {"model": ALIAS, "prompt": text, "return_token_strs": True})
    assert r.json()["token_strs"] == hf_tokenizer.convert_ids_to_tokens(want)
    assert r.json()["token_strs"][:2] == ["The", "Ġcapital"]


def test_add_special_tokens_reaches_the_tokenizer(
    keyed: LiveServer, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SmolLM2's tokenizer adds no BOS by itself: a spy shows what the server asked for.
    tokenizer = keyed.engine.tokenizer
    asked: list[bool] = []
    encode = tokenizer.encode

    def spy(text: str, add_special_tokens: bool = True, **kw: Any) -> list[int]:
        asked.append(add_special_tokens)
        return encode(text, add_special_tokens=add_special_tokens, **kw)

    monkeypatch.setattr(tokenizer, "encode", spy)
    for body, want in [
        ({"prompt": "Hi"}, True),  # vLLM's defaults: true for a prompt,
        ({"prompt": "Hi", "add_special_tokens": False}, False),
        ({"messages": CHAT}, False),  # false for messages (the template writes them)
        ({"messages": CHAT, "add_special_tokens": True}, True),
    ]:
        asked.clear()
        assert post(keyed, "/tokenize", body).status_code == 200
        assert asked == [want], body


def test_tokenize_messages_as_chat_completions_renders_them(
    keyed: LiveServer, hf_tokenizer: Any
) -> None:
    client = keyed.client(KEY)
    for body, want in [
        ({"messages": CHAT}, chat_ids(hf_tokenizer, CHAT)),
        (
            {"messages": CHAT, "add_generation_prompt": False},
            chat_ids(hf_tokenizer, CHAT, generation=False),
        ),
    ]:
        r = post(keyed, "/tokenize", body)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == want and r.json()["count"] == len(want)
    # The prompt chat completions computes for the same messages (and tools) is this one.
    for extra in ({}, {"tools": TOOLS}):
        counted = post(keyed, "/tokenize", {"messages": CHAT, **extra}).json()["count"]
        out = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1, **extra)
        assert out.usage.prompt_tokens == counted
    with_tools = post(keyed, "/tokenize", {"messages": CHAT, "tools": TOOLS}).json()
    assert with_tools["count"] > len(chat_ids(hf_tokenizer, CHAT))


# ----------------------------------------------------------------- /detokenize
def test_detokenize(keyed: LiveServer, hf_tokenizer: Any) -> None:
    text = "Hello world, ünïcödé!"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert post(keyed, "/detokenize", {"tokens": ids}).json() == {"prompt": text}
    special = [1, *ids, 2]  # special tokens are kept, as vLLM keeps them
    assert post(keyed, "/detokenize", {"tokens": special}).json() == {
        "prompt": hf_tokenizer.decode(special)
    }
    assert hf_tokenizer.decode(special).startswith("<|im_start|>")
    assert post(keyed, "/detokenize", {"model": ALIAS, "tokens": []}).json() == {"prompt": ""}


# -------------------------------------------------------------- /tokenizer_info
def test_tokenizer_info(keyed: LiveServer, hf_tokenizer: Any) -> None:
    r = httpx.get(keyed.url + "/tokenizer_info", headers=AUTH)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info == {
        "tokenizer_class": type(keyed.engine.tokenizer).__name__,
        "eos_token": "<|im_end|>",
        "eos_token_id": 2,
        "bos_token": "<|im_start|>",
        "bos_token_id": 1,
        "pad_token": "<|im_end|>",
        "pad_token_id": 2,
        "unk_token": "<|endoftext|>",
        "unk_token_id": 0,
        "chat_template": hf_tokenizer.chat_template,
        "model_max_length": keyed.engine.max_model_len,
        "vocab_size": 49152,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    assert "name_or_path" not in info  # the server's own paths stay on the server


# --------------------------------------------------------------------- errors
def test_tokenizer_routes_are_behind_the_key(keyed: LiveServer) -> None:
    for method, path, body in [
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/tokenizer_info", None),
    ]:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = httpx.request(method, keyed.url + path, json=body, headers=headers)
            check_error(r, 401, code="invalid_api_key")


def test_tokenizer_route_errors_name_the_field(keyed: LiveServer) -> None:
    check_error(post(keyed, "/tokenize", {}), 400, param="prompt", words=("prompt", "messages"))
    both = {"prompt": "x", "messages": CHAT}
    check_error(post(keyed, "/tokenize", both), 400, param="prompt")
    check_error(post(keyed, "/tokenize", {"prompt": 3}), 400, param="prompt")
    surrogate = '{"prompt": "a\\ud800"}'  # valid JSON, but no text a tokenizer can take
    check_error(raw(keyed, "/tokenize", surrogate), 400, param="prompt", words=("surrogate",))
    check_error(
        post(keyed, "/tokenize", {"prompt": "x", "add_special_tokens": "yes"}),
        400,
        param="add_special_tokens",
    )
    check_error(
        post(keyed, "/tokenize", {"messages": [{"role": "robot", "content": "x"}]}),
        400,
        param="messages[0].role",
    )
    check_error(
        post(keyed, "/tokenize", {"messages": CHAT, "continue_final_message": True}),
        400,
        param="continue_final_message",
        code="unsupported_parameter",
    )
    check_error(
        post(keyed, "/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}),
        400,
        param="tools[0]",
    )
    check_error(post(keyed, "/tokenize", {"prompt": "x", "tools": TOOLS}), 400, param="tools")
    many = {"messages": [{"role": "user", "content": "x"}] * 2049}
    check_error(post(keyed, "/tokenize", many), 400, param="messages", words=("2048",))
    check_error(
        post(keyed, "/tokenize", {"model": "gpt-4", "prompt": "x"}),
        404,
        param="model",
        code="model_not_found",
        words=("gpt-4", f"'{NAME}', '{ALIAS}'"),
    )
    check_error(post(keyed, "/detokenize", {}), 400, param="tokens", words=("tokens",))
    check_error(post(keyed, "/detokenize", {"tokens": [1, 2.5]}), 400, param="tokens")
    check_error(
        post(keyed, "/detokenize", {"tokens": [1, 49152]}),
        400,
        param="tokens",
        words=("[0, 49151]", "49152"),
    )
    check_error(post(keyed, "/detokenize", {"tokens": [-1]}), 400, param="tokens")
    check_error(post(keyed, "/detokenize", {"tokens": [2**70]}), 400, param="tokens")
    check_error(httpx.post(keyed.url + "/tokenize", content='{"prompt": ', headers=AUTH), 400)
    check_error(httpx.get(keyed.url + "/tokenize", headers=AUTH), 405)
    check_error(raw(keyed, "/tokenize", '{"prompt": "' + "x" * (1 << 20) + '"}'), 413)
    keyed.assert_pool_whole()


# ------------------------------------------------------------ several names
def test_every_served_name_is_accepted_and_the_first_is_echoed(keyed: LiveServer) -> None:
    client = keyed.client(KEY)
    assert [m.id for m in client.models.list().data] == [NAME, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    out = client.completions.create(model=ALIAS, prompt="Hi", max_tokens=2)
    assert out.model == NAME
    chat = client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=2)
    assert chat.model == NAME
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)


# ------------------------------------------------------------- finish_reason
def test_all_of_max_tokens_used_is_length_streamed_or_not(keyed: LiveServer) -> None:
    client = keyed.client(KEY)
    common: dict[str, Any] = dict(model=NAME, max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            prompt="Once upon a time",
            stream=True,
            stream_options={"include_usage": True},
            **common,
        )
    )
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    whole = client.completions.create(prompt="Once upon a time", **common)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 16
    chunks = list(
        client.chat.completions.create(
            messages=CHAT, stream=True, stream_options={"include_usage": True}, **common
        )
    )
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


# --------------------------------------------------- lm-evaluation-harness
def test_lm_eval_remote_tokenizer(keyed: LiveServer, hf_tokenizer: Any) -> None:
    utils = pytest.importorskip("lm_eval.utils")
    base = keyed.url + "/v1/completions"  # as lm-eval's local-completions is given it
    assert not utils.check_remote_tokenizer_support(base, auth_token="wrong", max_retries=1)
    assert utils.check_remote_tokenizer_support(base, auth_token=KEY)
    remote = utils.RemoteTokenizer(base, auth_token=KEY)
    text = "The capital of France is"
    assert remote.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert remote.decode(remote.encode(text)) == text
    assert (remote.eos_token, remote.eos_token_id, remote.bos_token_id) == ("<|im_end|>", 2, 1)
    rendered = remote.apply_chat_template(CHAT, add_generation_prompt=True)
    assert rendered == hf_tokenizer.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )
