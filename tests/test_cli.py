"""`pagedllm generate`: a run on a tiny model from a prompts file, and bad arguments that
exit non-zero with a one-line message."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedllm.entrypoints.cli import main


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
        (["--block-size", "0", "x"], "block_size must be in [1, 256], got 0"),
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


def test_argparse_errors_are_one_line() -> None:
    result = run_cli("generate", "--max-num-seqs", "0", "x")
    assert result.returncode == 2
    assert "must be an integer >= 1, got 0" in result.stderr.strip().splitlines()[-1]


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
