"""`pagedllm bench ...`: registers the bench subcommands on the main parser.

`add_bench_parser(subparsers)` adds `bench` with `throughput`, `memory`, `block-size`,
`attention`, `latency` and `report` (plus `serve`, from bench/serve.py, when present).
Each subcommand's `run(args)` returns its result dict; the CLI exits 0 after it.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from typing import Any

from pagedllm.bench import (
    attention,
    block_size,
    decode,
    latency,
    memory,
    report,
    sharing,
    throughput,
)

BENCHES = (throughput, memory, block_size, attention, latency, decode, sharing, report)


def _exit_code(run: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    def main(args: argparse.Namespace) -> int:
        out = run(args)
        return out if isinstance(out, int) else 0

    main.bench_run = run  # type: ignore[attr-defined]
    return main


def register(bench_sub: Any) -> None:
    """Add every bench subcommand to a `bench` subparsers object."""
    for module in BENCHES:
        module.add_parser(bench_sub)
    for parser in bench_sub.choices.values():
        parser.set_defaults(func=_exit_code(parser.get_default("func")))
    # Hook: `pagedllm bench serve` lives in bench/serve.py, written by the serve engineer;
    # it is registered when that file exists.
    if importlib.util.find_spec("pagedllm.bench.serve") is not None:
        from pagedllm.bench.serve import add_serve_bench_parser

        add_serve_bench_parser(bench_sub)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="benchmarks: throughput, memory, block-size, attention, latency, report"
    )
    register(p.add_subparsers(dest="bench_command", required=True, metavar="BENCH"))
    return p


def bench_parser() -> argparse.ArgumentParser:
    """A standalone `pagedllm bench` parser (the report parses its suite's commands with it)."""
    p = argparse.ArgumentParser(prog="pagedllm bench")
    register(p.add_subparsers(dest="bench_command", required=True, metavar="BENCH"))
    return p
