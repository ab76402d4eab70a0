"""`pagedllm kv-view TRACE -o run.html`: a self-contained HTML replay of a `--kv-trace` file.
A trace whose contents the page could not draw safely is refused, naming the field."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_kv_view_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "kv-view",
        help="write one HTML file that replays a KV trace (pagedllm generate --kv-trace)",
    )
    p.add_argument("trace", help="a trace written by `pagedllm generate --kv-trace FILE`")
    p.add_argument(
        "-o", "--output", default=None, help="the HTML file to write (default: TRACE with .html)"
    )
    p.set_defaults(func=run_kv_view)
    return p


def run_kv_view(args: argparse.Namespace) -> int:
    from pagedllm.engine.kv_trace import load_trace
    from pagedllm.entrypoints.kv_view.page import render
    from pagedllm.entrypoints.kv_view.trace_check import check_trace

    trace = load_trace(args.trace)
    try:
        check_trace(trace)
    except ValueError as exc:
        raise ValueError(f"the replay page cannot draw {args.trace}: {exc}") from None
    output = Path(args.output) if args.output else Path(args.trace).with_suffix(".html")
    if output.resolve() == Path(args.trace).resolve():
        raise ValueError(f"the output {output} would overwrite the trace; pass -o")
    title = f"pagedllm KV replay: {Path(args.trace).name}"
    output.write_text(render("replay", trace, title=title), encoding="utf-8")
    records = trace["records"]
    steps = records[-1]["step"] - trace["start"]["step"] if records else 0
    events = sum(len(r["ev"]) for r in records)
    print(f"wrote {output}: {steps} steps, {events} KV events; open it in a browser")
    return 0
