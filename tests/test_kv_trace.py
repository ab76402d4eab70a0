"""`pagedllm generate --kv-trace` and `pagedllm kv-view`: a trace of parallel sampling and
of a beam search replays to an empty pool and holds their forks and copies; the replay
file is one self-contained page that carries the trace; bad input exits with one line."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pagedllm.engine.kv_trace import load_trace
from pagedllm.entrypoints.cli import main
from pagedllm.kv.pool_state import PoolState


def generate(model: Path, trace: Path, *args: str) -> dict[str, Any]:
    prompts = trace.with_suffix(".jsonl")
    prompts.write_text('{"prompt_token_ids": [1, 2, 3, 4, 5, 6]}\n{"prompt_token_ids": [7, 8]}\n')
    argv = ["generate", "--model", str(model), "--prompts-file", str(prompts), "--json"]
    argv += ["--max-tokens", "6", "--ignore-eos", "--block-size", "4", "--num-kv-blocks", "64"]
    argv += ["--kv-trace", str(trace)]
    assert main([*argv, *args]) == 0
    loaded = load_trace(trace)
    assert loaded["meta"]["command"] == " ".join(["pagedllm", *argv, *args])  # not pytest's
    return loaded


def replay(trace: dict[str, Any]) -> tuple[PoolState, Counter[str]]:
    state = PoolState.from_json(trace["start"]["pool"])
    kinds: Counter[str] = Counter()
    for record in trace["records"]:
        state.apply_all(record["ev"])
        kinds.update(e["k"] for e in record["ev"])
    return state, kinds


@pytest.mark.parametrize(
    ("args", "width"),
    [(["--n", "4", "--temperature", "0.8", "--seed", "1"], 4), (["--beam-width", "3"], 3)],
)
def test_trace_of_shared_blocks(tmp_path: Path, tiny_llama_dir: Path, args, width) -> None:
    trace = generate(tiny_llama_dir, tmp_path / "run.json", *args)
    assert trace["meta"]["text"] is False
    steps = [r["step"] for r in trace["records"]]
    assert steps == sorted(steps) and steps[0] == trace["start"]["step"] + 1
    state, kinds = replay(trace)
    assert not state.tables and not any(state.ref)  # everything was freed
    assert kinds["fork"] >= 2 * (width - 1) and kinds["cow"] > 0  # both prompts forked
    assert kinds["finish"] == 2
    peak = max(r["st"]["seqs"] for r in trace["records"])
    assert peak == 2 * width
    assert "text" not in json.dumps(trace["records"])


def test_kv_view_writes_one_self_contained_page(tmp_path: Path, tiny_llama_dir: Path) -> None:
    path = tmp_path / "run.json"
    trace = generate(tiny_llama_dir, path, "--beam-width", "2")
    out = tmp_path / "replay.html"
    assert main(["kv-view", str(path), "-o", str(out)]) == 0
    page = out.read_text()
    # Nothing to fetch: no script or stylesheet by address, no URL at all.
    assert "<script src" not in page and "<link" not in page
    assert not re.search(r"https?://", page)
    embedded = re.search(
        r'<script type="application/json" id="kv-trace">(.*?)</script>', page, re.S
    )
    assert embedded is not None and json.loads(embedded.group(1)) == trace
    assert main(["kv-view", str(path)]) == 0  # default: the trace's name with .html
    assert path.with_suffix(".html").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["kv-view", "{trace}"], "is not JSON"),
        (["kv-view", "{missing}"], "cannot read the trace"),
        (["generate", "x", "--kv-trace-text"], "--kv-trace-text needs --kv-trace"),
        (["generate", "x", "--beam-width", "2", "--n", "2"], "--beam-width and --n"),
    ],
)
def test_bad_input_exits_with_one_line(
    argv: list[str], message: str, tmp_path: Path, tiny_llama_dir: Path, capsys
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    argv = [a.format(trace=bad, missing=tmp_path / "none.json") for a in argv]
    if argv[0] == "generate":
        argv += ["--model", str(tiny_llama_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_json_file_that_is_not_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"records": []}')
    with pytest.raises(ValueError, match="not a pagedllm KV trace"):
        load_trace(path)
