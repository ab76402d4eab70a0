"""guidellm, a load-testing tool for OpenAI-compatible servers, run unchanged (its own CLI,
in a subprocess, offline) against a real server over the tiny chat model: every request of
a small fixed load succeeds, with exactly the output length it asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from live_server import NAME, LiveServer

pytest.importorskip("guidellm")

PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16
REQUESTS = 8


def run_guidellm(url: str, request_format: str, tokenizer: Path, tmp_path: Path) -> dict[str, Any]:
    """One guidellm benchmark: REQUESTS synthetic requests, 4 at a time; its JSON report."""
    report = tmp_path / "report.json"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",  # the tokenizer is read from the model's folder
        "HF_DATASETS_OFFLINE": "1",
        # One worker process (each one imports torch) keeps it light on a small machine.
        "GUIDELLM__MAX_WORKER_PROCESSES": "1",
    }
    # No `model=`: guidellm takes the first name from /v1/models, as a user's run does.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "guidellm",
            "run",
            "--backend",
            f"kind=openai_http,target={url},request_format={request_format}",
            "--profile",
            "kind=concurrent,streams=4",
            "--constraint",
            f"kind=max_requests,count={REQUESTS}",
            "--data",
            f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
            "--tokenizer",
            f"kind=hf_auto,model={tokenizer}",
            "--output",
            f"kind=json,path={report}",
            "--disable-console",
        ],
        cwd=tmp_path,  # guidellm reads a .env file from its working folder
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard, not a timing assertion
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.mark.parametrize("request_format", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_load_gets_every_request_at_its_exact_length(
    server: LiveServer, chat_model_dir: Path, tmp_path: Path, request_format: str
) -> None:
    before = server.metrics()
    report = run_guidellm(server.url, request_format, chat_model_dir, tmp_path)
    server.assert_pool_whole()
    after = server.metrics()
    (benchmark,) = report["benchmarks"]
    requests = benchmark["requests"]
    assert (len(requests["errored"]), len(requests["incomplete"])) == (0, 0), requests
    successful = requests["successful"]
    assert len(successful) == REQUESTS
    for r in successful:
        assert json.loads(r["request_args"])["body"]["model"] == NAME
        assert r["output"], r
        # guidellm reports the server's own usage when it comes (it falls back to the
        # asked length otherwise); cached_tokens comes only from the server's usage.
        assert r["output_metrics"]["text_tokens"] == OUTPUT_TOKENS, r
        assert r["input_metrics"]["cached_tokens"] is not None, r
    if request_format == "/v1/completions":
        # guidellm sized each prompt with the same tokenizer the server counts with.
        assert [r["input_metrics"]["text_tokens"] for r in successful] == [PROMPT_TOKENS] * REQUESTS

    def grew(name: str) -> float:
        return after.get(f"pagedllm:{name}", 0) - before.get(f"pagedllm:{name}", 0)

    # The server's side: every request generated exactly the asked length, ended by it.
    assert grew("generation_tokens_total") == REQUESTS * OUTPUT_TOKENS
    assert grew('request_finished_total{finished_reason="length"}') == REQUESTS
