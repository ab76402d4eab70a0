"""Hostile structured-output and tool requests against a live server: every one is a 400
naming the client's field, found by the cheap checks before any grammar compiles, and none
reaches a 500. Covers JSON nested thousands deep (a guided_json string, a schema, a tool
call's arguments in the history, tool parameters), a grammar with no finite sentence, and
requests that could never run whatever their grammar."""

from __future__ import annotations

import json
import random
import string
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from inspect_internals import grammar_cache_bytes, num_compiles
from live_server import CHAT, NAME, LiveServer, check_error, start_server


def post(server: LiveServer, path: str, **body: Any) -> httpx.Response:
    if path == "chat/completions":
        body.setdefault("messages", CHAT)
    else:
        body.setdefault("prompt", "Hi")
    return httpx.post(f"{server.url}/v1/{path}", json={"model": NAME, **body}, timeout=120)


def nested_arrays_schema(depth: int) -> dict[str, Any]:
    """The schema of arrays nested `depth` deep (900: about 60 KB of JSON once the
    annotations a client would add are counted)."""
    schema: dict[str, Any] = {"type": "integer"}
    for i in range(depth):
        schema = {"type": "array", "items": schema, "description": f"level {i}"}
    return schema


def compiles(server: LiveServer) -> int:
    """Grammar compiles started so far (none before the compiler is built)."""
    compiler = server.engine.engine.grammars._compiler
    return 0 if compiler is None else num_compiles(compiler)


def test_deep_json_anywhere_in_a_request_is_a_400_naming_its_field(server: LiveServer) -> None:
    chat, cmpl = "chat/completions", "completions"
    deep_text = "[" * 3000 + "]" * 3000  # JSON nested 3000 deep, as text
    deep_object = '{"a":' * 3000 + "1" + "}" * 3000
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep_object}}
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    deep_schema = nested_arrays_schema(500)  # within what the body parser reads
    deep_parameters = {"type": "object", "properties": {"x": deep_schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep_parameters}}
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": deep_schema}}
    cases = [
        (cmpl, {"guided_json": deep_text}, "guided_json"),
        (cmpl, {"guided_json": deep_object}, "guided_json"),
        (cmpl, {"structured_outputs": {"json": deep_object}}, "structured_outputs.json"),
        (cmpl, {"guided_json": deep_schema}, "guided_json"),
        (chat, {"guided_json": deep_text}, "guided_json"),
        (chat, {"messages": history}, "messages[1].tool_calls[0].function.arguments"),
        (chat, {"response_format": rf}, "response_format.json_schema"),
        (chat, {"tools": [tool]}, "tools[0].function.parameters"),
        (chat, {"tools": [tool], "tool_choice": "required"}, "tools[0].function.parameters"),
        (cmpl, {"guided_choice": [deep_text]}, None),  # a choice is text, not JSON: served
    ]
    before = compiles(server)
    for path, body, param in cases:
        r = post(server, path, max_tokens=3, **body)
        if param is None:
            assert r.status_code == 200, r.text
            continue
        check_error(r, 400, param=param, words=("nests deeper than",))
    assert compiles(server) - before == 1  # only the choice compiled
    server.assert_pool_whole()


def test_the_issues_900_deep_schema_is_refused_before_it_compiles(server: LiveServer) -> None:
    schema = nested_arrays_schema(900)
    body = json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 3, "guided_json": schema})
    assert len(body) > 40_000
    for _ in range(2):
        r = httpx.post(
            f"{server.url}/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        check_error(r, 400, param="guided_json", words=("nests deeper",))
    # Nothing holds a compile slot: a new grammar compiles at once.
    r = post(server, "completions", max_tokens=4, guided_regex="[pq]{4}")
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 4, r.text
    server.assert_pool_whole()


def test_a_grammar_with_no_finite_sentence_is_a_400_at_compile_time(server: LiveServer) -> None:
    for grammar in ["root ::= a\na ::= root", 'root ::= "x" root', 'root ::= "a" b\nb ::= b "c"']:
        for path in ("completions", "chat/completions"):
            r = post(server, path, max_tokens=5, guided_grammar=grammar)
            check_error(r, 400, param="guided_grammar", words=("no finite",))
    # A recursive grammar with a way out is fine.
    r = post(server, "completions", max_tokens=8, guided_grammar='root ::= "x" root | "y"')
    assert r.status_code == 200, r.text
    server.assert_pool_whole()


def test_requests_that_can_never_run_are_refused_before_their_grammar(server: LiveServer) -> None:
    # The model's context is 512 tokens: each of these fails a cheap check, whatever its
    # grammar, and is told so before the grammar compiles.
    before = compiles(server)
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    long_prompt = [100] * 5000
    for path, body, param in [
        ("completions", {"prompt": long_prompt, "guided_json": schema}, "prompt"),
        ("completions", {"prompt": [[1, 2], long_prompt], "guided_regex": "[ab]+"}, "prompt"),
        ("completions", {"n": 5000, "guided_json": schema}, "n"),
        ("completions", {"max_tokens": 5000, "guided_grammar": 'root ::= "z"'}, "max_tokens"),
        ("chat/completions", {"max_tokens": 5000, "guided_choice": ["a", "b"]}, "max_tokens"),
        ("chat/completions", {"n": 5000, "response_format": {"type": "json_object"}}, "n"),
        ("completions", {"prompt": [60000], "guided_regex": "[cd]+"}, "prompt"),
    ]:
        r = post(server, path, **body)
        check_error(r, 400, param=param)
    assert compiles(server) == before
    server.assert_pool_whole()


def test_the_engine_thread_never_compiles(chat_model_dir) -> None:
    """With no grammar kept in the cache (a bound of 0), the server hands the engine the
    grammar it compiled: the engine thread never compiles one itself."""
    server = start_server(chat_model_dir, {"grammar_cache_mb": 0})
    try:
        for _ in range(2):
            r = post(server, "completions", max_tokens=4, guided_regex="[ef]{4}")
            assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 4, r.text
        compiler = server.engine.engine.grammars.compiler
        assert num_compiles(compiler) == 2  # nothing cached: compiled for each request
        assert grammar_cache_bytes(compiler) == 0
        assert all(t.startswith("pagedllm-grammar") for t in compiler.compiles_by_thread)
        server.assert_pool_whole()
    finally:
        server.close()


def test_a_request_the_backlog_refuses_is_refused_before_its_grammar(server: LiveServer) -> None:
    """With no room in the backlog (max_waiting 0: every request waits beyond it), a
    request with a grammar gets its 503 before the grammar compiles."""
    before = compiles(server)
    server.engine.max_waiting = 0
    try:
        r = post(server, "completions", max_tokens=4, guided_regex="[gh]{3}[ij]")
    finally:
        server.engine.max_waiting = None
    check_error(r, 503, code="server_overloaded")
    assert compiles(server) == before
    server.assert_pool_whole()


def test_health_and_plain_requests_are_served_while_every_compiler_is_busy(
    server: LiveServer,
) -> None:
    """Two grammars that take seconds to compile hold both compile workers: meanwhile
    /health and a request without a grammar are answered, before either compile ends."""
    rng = random.Random(5)
    slow = [
        ["".join(rng.choices(string.ascii_lowercase, k=10)) for _ in range(60_000)]
        for _ in range(2)
    ]
    with ThreadPoolExecutor(2) as pool:
        floods = [pool.submit(post, server, "completions", guided_choice=c) for c in slow]
        compiler = server.engine.engine.grammars._compiler
        deadline = time.monotonic() + 60  # a hang guard
        while compiler is None or len(compiler.pool._done_by) < 2:
            assert time.monotonic() < deadline, "the compiles never started"
            time.sleep(0.01)
            compiler = server.engine.engine.grammars._compiler
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        r = post(server, "completions", max_tokens=4)
        assert r.status_code == 200, r.text
        assert not any(f.done() for f in floods)  # both compiles were still running
        for f in floods:
            assert f.result().status_code in (200, 400)
    server.assert_pool_whole()
