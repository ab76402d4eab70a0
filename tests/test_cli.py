"""`pagedllm generate`: a run on a tiny model from a prompts file, bad arguments that
exit non-zero with a one-line message, and the engine options every command shares."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedllm.entrypoints.cli import build_parser, main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "0", "x"], "block_size must be an integer in [1, 256], got 0"),
        (["--max-tokens", "-3", "x"], "max_tokens must be an integer >= 1, got -3"),
        (["--model", "/no/such/model", "x"], "model path /no/such/model does not exist"),
        (["--kv-cache-memory", "lots", "x"], "kv_cache_memory must be a byte count"),
        ([], "give at least one prompt"),
    ],
)
def test_bad_arguments_exit_with_one_line(args, message, capsys, tiny_llama_dir) -> None:
    if "--model" not in args:
        args = ["--model", str(tiny_llama_dir), *args]
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_chat_without_a_chat_template_is_refused(capsys, tiny_llama_dir) -> None:
    assert main(["generate", "--model", str(tiny_llama_dir), "--chat", "hi"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the engine's INFO lines
    assert "--chat needs the model's chat template" in last, last
    assert "give the prompts without --chat" in last


def test_bad_engine_option_exits_2_with_one_line_from_the_shell() -> None:
    """As a process (not main()): exit status 2, the message last, no traceback."""
    result = run_cli("generate", "--max-num-seqs", "0", "x")
    assert result.returncode == 2
    assert "must be an integer >= 1, got 0" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-request-bytes", "0"], "max_request_bytes must be an integer >= 1, got 0"),
        (["--body-timeout", "nan"], "body_timeout must be > 0 seconds, got nan"),
        (
            ["--max-prompts-per-request", "0"],
            "max_prompts_per_request must be an integer >= 1, got 0",
        ),
        (["--shutdown-timeout", "-1"], "shutdown_timeout must be a finite number of seconds >= 0"),
        (["--shutdown-timeout", "inf"], "shutdown_timeout must be a finite number of seconds"),
        (["--shutdown-timeout", "nan"], "shutdown_timeout must be a finite number of seconds"),
        (["--ray", "--shutdown-timeout", "3"], "--shutdown-timeout is not read with --ray"),
    ],
)
def test_bad_serve_limits_exit_with_one_line_before_loading(args, message, capsys) -> None:
    # No such model: the limits are checked first, or the message would be the model's.
    assert main(["serve", "--model", "/no/such/model", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize(
    ("argv", "default"),
    [
        (["generate", "x"], True),
        (["serve"], True),
        (["bench", "throughput"], False),  # the benches start with prefix caching off
        (["bench", "sharing"], False),
    ],
)
def test_prefix_caching_can_be_turned_on_and_off_whatever_the_default(argv, default) -> None:
    parser = build_parser()
    assert parser.parse_args(argv).enable_prefix_caching is default
    assert parser.parse_args([*argv, "--prefix-caching"]).enable_prefix_caching is True
    assert parser.parse_args([*argv, "--no-prefix-caching"]).enable_prefix_caching is False


def test_generate_from_prompts_file(tmp_path, tiny_llama_dir, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n\n{"prompt_token_ids": [5, 6]}\n')
    code = main(
        [
            "generate",
            "--model",
            str(tiny_llama_dir),
            "--prompts-file",
            str(prompts),
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--block-size",
            "4",
            "--json",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    summary = result["summary"]
    assert summary["requests"] == 2
    assert summary["prompt_tokens"] == 5
    assert summary["generated_tokens"] == 10
    assert summary["peak_blocks_in_use"] == 4  # (3 + 5) / 4 + (2 + 5) / 4 blocks
    assert summary["preemptions"] == 0
