"""`pagedllm bench ...`: registers every bench subcommand on the main parser. A bench's
`run(args)` returns its result dict; the command exits with its "exit_code" (default 0).
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.bench import (
    engine_benches,
    llamacpp,
    lora,
    quality,
    report,
    scale_out,
    serve,
    spec_decode,
    spec_streams,
    step_cost,
    structured,
    sweep_benches,
)

BENCH_MODULES = (
    quality,
    structured,
    spec_decode,
    spec_streams,
    step_cost,
    serve,
    scale_out,
    llamacpp,
    lora,
    report,
)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmarks: throughput, memory, latency, ... report")
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    sweep_benches.add_parsers(sub)
    engine_benches.add_parsers(sub)
    for module in BENCH_MODULES:
        module.add_parser(sub)
    for parser in sub.choices.values():
        run = parser.get_default("func")
        parser.set_defaults(func=lambda args, run=run: int(run(args).get("exit_code", 0)))
    return p
