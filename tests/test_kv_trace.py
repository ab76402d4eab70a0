"""`pagedllm generate --kv-trace` and `pagedllm kv-view`: a trace of parallel sampling and
of a beam search replays to an empty pool and holds their forks and copies; the replay
file is one self-contained page that carries the trace, under a Content-Security-Policy
that lets its own script run and nothing else; bad input exits with one line, and so does
a trace with a value the page could not draw safely, naming the field."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pagedllm.engine.kv_trace import load_trace
from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.kv_view import page as page_module
from pagedllm.entrypoints.kv_view.page import render
from pagedllm.entrypoints.kv_view.trace_check import check_trace
from pagedllm.kv.events import EVENT_FIELDS
from pagedllm.kv.pool_state import PoolState
from pool_replay import pool_from_json, replay


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


def replay_trace(trace: dict[str, Any]) -> tuple[PoolState, Counter[str]]:
    state = pool_from_json(trace["start"]["pool"])
    kinds: Counter[str] = Counter()
    for record in trace["records"]:
        replay(state, record["ev"])
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
    state, kinds = replay_trace(trace)
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


def test_the_replay_page_runs_its_own_script_only(tmp_path: Path, tiny_llama_dir: Path) -> None:
    path = tmp_path / "run.json"
    generate(tiny_llama_dir, path)
    out = tmp_path / "replay.html"
    assert main(["kv-view", str(path), "-o", str(out)]) == 0
    page = out.read_text()
    meta = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', page)
    assert meta is not None
    policy = dict(part.split(" ", 1) for part in meta.group(1).split("; "))
    assert policy["default-src"] == policy["connect-src"] == "'none'"

    def sha(tag: str) -> str:
        (code,) = re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.S)
        return "'sha256-" + base64.b64encode(hashlib.sha256(code.encode()).digest()).decode() + "'"

    assert policy["script-src"] == sha("script") and policy["style-src"] == sha("style")


@pytest.fixture(scope="module")
def text_trace(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> dict[str, Any]:
    """A real trace of four parallel samples, with a `text` event added (the tiny model
    has no tokenizer to write one)."""
    path = tmp_path_factory.mktemp("trace") / "run.json"
    trace = generate(tiny_llama_dir, path, "--n", "4", "--seed", "1")
    trace["records"][0]["ev"].append({"k": "text", "block": 0, "text": "Hello"})
    return trace


def first(trace: dict[str, Any], kind: str) -> tuple[int, int]:
    """(record, event) of the first event of `kind`."""
    for i, record in enumerate(trace["records"]):
        for j, event in enumerate(record["ev"]):
            if event["k"] == kind:
                return i, j
    raise AssertionError(f"no {kind} event")


def test_real_traces_pass_the_check(text_trace: dict[str, Any]) -> None:
    check_trace(text_trace)
    kinds = {e["k"] for r in text_trace["records"] for e in r["ev"]}
    assert {"alloc", "fork", "cow", "free", "finish"} <= kinds


BAD_VALUES = [
    (
        lambda t: t["records"][3]["st"].update(used="x"),
        "records[3].st.used must be a number, got 'x'",
    ),
    (lambda t: t["records"][0]["st"].update(run="<b>"), "records[0].st.run must be a number"),
    (lambda t: t["records"][0]["st"].update(util=float("nan")), "records[0].st.util must be a num"),
    (lambda t: t["records"][0]["st"].update(run=True), "records[0].st.run must be a number"),
    (lambda t: t["start"]["st"].update(wait=[1]), "start.st.wait must be a number, got [1]"),
    (lambda t: t["records"][1].update(step="2"), "records[1].step must be a whole number"),
    (lambda t: t["start"]["pool"].update(num_blocks="64"), "start.pool.num_blocks must be a whole"),
    (lambda t: t["start"]["pool"]["ref"].pop(), "start.pool.ref must hold 64 values, got 63"),
    (lambda t: t["meta"].update(command=["x"]), "meta.command must be a string"),
]


def _event(kind: str, field: str, value: Any) -> Any:
    def change(trace: dict[str, Any]) -> None:
        i, j = first(trace, kind)
        trace["records"][i]["ev"][j][field] = value

    return change


BAD_EVENTS = [
    ("alloc", "blocks", ["3"], "blocks[0] must be a block id in [0, 64), got '3'"),
    ("alloc", "blocks", [64], "blocks[0] must be a block id in [0, 64), got 64"),
    ("alloc", "seq", "1", ".seq must be a whole number >= 0, got '1'"),
    ("alloc", "req", 7, ".req must be a request id (a string), got 7"),
    ("alloc", "tokens", -1, ".tokens must be a whole number >= 0, got -1"),
    ("fork", "parent", None, ".parent must be a whole number >= 0, got None"),
    ("cow", "dst", 1.5, ".dst must be a block id in [0, 64), got 1.5"),
    ("text", "text", {"a": 1}, ".text must be a string"),
    ("alloc", "k", "<img>", ".k must be one of alloc, append"),
]


@pytest.mark.parametrize(
    ("change", "message"),
    BAD_VALUES + [(_event(k, f, v), m) for k, f, v, m in BAD_EVENTS],
)
def test_kv_view_refuses_a_trace_it_could_not_draw(
    change: Any, message: str, text_trace: dict[str, Any], tmp_path: Path, capsys
) -> None:
    trace = copy.deepcopy(text_trace)
    change(trace)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(trace))
    with pytest.raises(ValueError, match=re.escape(message)):
        check_trace(trace)
    assert main(["kv-view", str(path), "-o", str(tmp_path / "bad.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "cannot draw" in err[0], err
    assert not (tmp_path / "bad.html").exists()


def test_a_missing_event_field_is_named(text_trace: dict[str, Any]) -> None:
    trace = copy.deepcopy(text_trace)
    i, j = first(trace, "cow")
    del trace["records"][i]["ev"][j]["index"]
    with pytest.raises(ValueError, match=re.escape(f"records[{i}].ev[{j}].index is missing")):
        check_trace(trace)


def test_the_pages_script_reads_the_event_table() -> None:
    """The page carries kv/events.py's table of event fields, and the script's replay and
    log read no field of an event that its kind's row lacks."""
    page = render("live")
    config = json.loads(re.search(r'id="kv-config">(.*?)</script>', page).group(1))
    assert config["events"] == {kind: list(fields) for kind, fields in EVENT_FIELDS.items()}
    script = (Path(page_module.__file__).parent / "static" / "kv_view.js").read_text()
    for opening in ("apply(ev) {", "function describe(e) {"):
        body = script[script.index(opening) :]
        cases = body[: body.index("default:")].split('case "')[1:]
        assert len(cases) >= 12, opening
        for case in cases:
            kind = case[: case.index('"')]
            used = set(re.findall(r"\be\.(\w+)", case))
            assert used <= {"k", "g", *EVENT_FIELDS[kind]}, (opening, kind, used)


def test_the_docs_list_the_event_table() -> None:
    """docs/kv-view.md's table of events names exactly each kind's fields."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "kv-view.md").read_text()
    rows = re.findall(r"^\| (`\w+`(?: / `\w+`)*) \|([\w ]*)\|", doc, re.MULTILINE)
    documented = {
        kind.strip("`"): fields.split() for kinds, fields in rows for kind in kinds.split(" / ")
    }
    assert documented == {kind: list(fields) for kind, fields in EVENT_FIELDS.items()}
