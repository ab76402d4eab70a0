"""The server's HTTP edges: keys and KV view tokens compared as bytes (non-ASCII input is
a 401, never a 500), CORS for the official clients' own headers, error codes for unknown
paths and methods, X-Request-Id echoed on every response (and engine request ids kept
apart), and the security headers on HTML pages."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from live_server import NAME, LiveServer, check_error, start_server

KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def keyed(chat_model_dir: Path) -> Iterator[LiveServer]:
    """A server with an API key and one allowed browser origin."""
    live = start_server(chat_model_dir, api_key="s3cret", allowed_origins=["http://app.example"])
    yield live
    live.close()


def test_a_non_ascii_kv_token_or_key_is_a_401(keyed: LiveServer) -> None:
    r = httpx.get(keyed.url + "/kv/events?token=1.%C3%A9")
    check_error(r, 401, code="invalid_api_key")
    # '²' passes str.isdigit() but not int(): still a 401.
    check_error(httpx.get(keyed.url + "/kv/events?token=%C2%B2.abc"), 401, code="invalid_api_key")
    for key in ("s3crét".encode(), b"\xff\xfe", "ключ".encode()):
        headers = [(b"authorization", b"Bearer " + key)]
        check_error(httpx.get(keyed.url + "/v1/models", headers=headers), 401)
        check_error(httpx.get(keyed.url + "/kv/snapshot", headers=headers), 401)
    assert keyed.rejected(500) == 0


def test_a_non_ascii_api_key_works_when_sent_as_utf8(chat_model_dir: Path) -> None:
    live = start_server(chat_model_dir, api_key="clé")
    try:
        good = [(b"authorization", "Bearer clé".encode())]
        assert httpx.get(live.url + "/v1/models", headers=good).status_code == 200
        bad = [(b"authorization", "Bearer clé".encode("latin-1"))]
        check_error(httpx.get(live.url + "/v1/models", headers=bad), 401)
    finally:
        live.close()


def test_cors_preflight_allows_the_official_clients_headers(keyed: LiveServer) -> None:
    ask = {
        "Origin": "http://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "x-stainless-os,openai-organization,x-request-id",
    }
    r = httpx.options(keyed.url + "/v1/chat/completions", headers=ask)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    allowed = r.headers["access-control-allow-headers"].lower()
    for header in ("x-stainless-os", "openai-organization", "x-request-id"):
        assert header in allowed
    # Other origins still get nothing.
    other = httpx.options(keyed.url + "/v1/chat/completions", headers={**ask, "Origin": "http://x"})
    assert "access-control-allow-origin" not in other.headers
    # A browser may read the request id back.
    r = httpx.get(keyed.url + "/v1/models", headers={"Origin": "http://app.example", **KEY})
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


def test_unknown_paths_and_methods_have_codes(server: LiveServer) -> None:
    error = check_error(httpx.get(server.url + "/v1/nothing"), 404, code="not_found")
    assert error["type"] == "not_found_error"
    assert error["message"] == "there is no GET /v1/nothing on this server"
    r = httpx.get(server.url + "/v1/completions")
    error = check_error(r, 405, code="method_not_allowed")
    assert error["message"] == "GET /v1/completions is not allowed; use POST"
    assert r.headers["allow"] == "POST"


def test_x_request_id_is_echoed_on_every_response(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    url = server.url + "/v1/completions"
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2}
    mine = {"X-Request-Id": "trace-42"}
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        r = httpx.post(url, json=body, headers=mine)
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
        first = r.json()["id"]
        # The same id again: a separate engine request all the same.
        second = httpx.post(url, json=body, headers=mine).json()["id"]
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=mine) as s:
            assert s.status_code == 200 and s.headers["x-request-id"] == "trace-42"
            assert list(s.iter_lines())[-2] == "data: [DONE]"
        error = httpx.post(url, json={**body, "top_p": 2}, headers=mine)
        assert error.status_code == 400 and error.headers["x-request-id"] == "trace-42"
    assert first != second
    assert re.fullmatch(r"cmpl-trace-42-\d+", first) and re.fullmatch(r"cmpl-trace-42-\d+", second)
    logged = [r.getMessage() for r in caplog.records if r.name == "pagedllm"]
    assert sum(m.startswith("request trace-42: /v1/completions") for m in logged) == 3
    assert any(m.startswith("request trace-42: POST /v1/completions answered 400") for m in logged)
    # None sent: one is made, and it is in the response id.
    for path in ("/v1/models", "/health", "/v1/nothing", "/kv"):
        made = httpx.get(server.url + path).headers["x-request-id"]
        assert re.fullmatch("[0-9a-f]{32}", made), path
    r = httpx.post(url, json=body)
    assert r.json()["id"].startswith(f"cmpl-{r.headers['x-request-id']}-")
    # An id that could not go back in a header or a log line is replaced.
    odd = httpx.get(server.url + "/health", headers={"X-Request-Id": "x" * 300})
    assert re.fullmatch("[0-9a-f]{32}", odd.headers["x-request-id"])


def test_pages_carry_security_headers(server: LiveServer) -> None:
    for path in ("/kv", "/v1/models", "/health", "/v1/nothing"):
        r = httpx.get(server.url + path)
        assert r.headers["x-content-type-options"] == "nosniff", path
        assert r.headers["x-frame-options"] == "DENY", path
    page = httpx.get(server.url + "/kv")
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "default-src 'none'" in csp
    assert "connect-src 'self'" in csp
    # Inline code runs by hash only: never 'unsafe-inline', and one hash per inline block.
    assert "unsafe" not in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]{44}'(;|$)", csp)
    assert re.search(r"style-src 'sha256-[A-Za-z0-9+/=]{44}'(;|$)", csp)
    meta = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', page.text)
    assert meta is not None and "frame-ancestors" not in meta.group(1)


def test_docs_pages_carry_a_policy(chat_model_dir: Path) -> None:
    live = start_server(chat_model_dir, enable_docs=True)
    try:
        for path in ("/docs", "/redoc"):
            r = httpx.get(live.url + path)
            csp = r.headers["content-security-policy"]
            assert "https://cdn.jsdelivr.net" in csp and "frame-ancestors 'none'" in csp, path
            assert r.headers["x-frame-options"] == "DENY"
    finally:
        live.close()
