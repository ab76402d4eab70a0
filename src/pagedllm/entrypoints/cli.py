"""The `pagedllm` command line: `generate`, plus the `serve`, `bench` and `kv-view`
subcommands.

Bad arguments exit with status 2 and a one-line message, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from pagedllm.bench.cli import add_bench_parser
from pagedllm.entrypoints.engine_args import add_engine_args, engine_options
from pagedllm.entrypoints.kv_view.cli import add_kv_view_parser
from pagedllm.entrypoints.server.serve_cli import add_serve_parser


def _add_generate(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("prompts", nargs="*", help="prompts (or use --prompts-file)")
    p.add_argument(
        "--prompts-file",
        default=None,
        help="one JSON string, or object with 'prompt'/'prompt_token_ids', per line",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument(
        "--beam-width",
        type=int,
        default=None,
        help="beam search with this many beams instead of sampling (outputs best first)",
    )
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system prompt for --chat")
    p.add_argument("--json", action="store_true", help="print outputs and summary as JSON")
    p.add_argument(
        "--kv-trace",
        default=None,
        metavar="FILE",
        help="record the run's KV events (blocks allocated, shared, copied, freed) in FILE "
        "for `pagedllm kv-view FILE`",
    )
    p.add_argument(
        "--kv-trace-text",
        action="store_true",
        help="keep each KV block's token text in the trace (off: ids and counts only)",
    )
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def _read_prompts(args: argparse.Namespace) -> list[Any]:
    prompts: list[Any] = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                lines = [line for line in f if line.strip()]
        except OSError as e:
            raise ValueError(
                f"cannot read --prompts-file: {e.strerror}: {args.prompts_file}"
            ) from None
        for n, line in enumerate(lines, 1):
            try:
                prompts.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"--prompts-file line {n} is not JSON: {e.msg}") from None
    if not prompts:
        raise ValueError("give at least one prompt (arguments or --prompts-file)")
    return prompts


def run_generate(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import BeamSearchParams, SamplingParams

    prompts = _read_prompts(args)
    params: SamplingParams | BeamSearchParams
    if args.beam_width is not None:
        if args.n != 1:
            raise ValueError("--beam-width and --n do not go together: a beam search keeps k beams")
        params = BeamSearchParams(
            beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos
        )
    else:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            n=args.n,
            ignore_eos=args.ignore_eos,
        )
    if args.kv_trace_text and not args.kv_trace:
        raise ValueError("--kv-trace-text needs --kv-trace FILE")
    llm = LLM(**engine_options(args))
    if args.chat and not getattr(llm.get_tokenizer(), "chat_template", None):
        raise ValueError(
            "--chat needs the model's chat template, and this model has none (a base model, "
            "not an instruction-tuned one): give the prompts without --chat"
        )
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [
            {"prompt_token_ids": llm.encode_chat([*system, {"role": "user", "content": str(p)}])}
            for p in prompts
        ]
    trace = None
    if args.kv_trace:
        from pagedllm.engine.kv_trace import KVTrace

        command = "pagedllm " + " ".join(args.argv)
        trace = KVTrace.record(llm.engine, text=args.kv_trace_text, command=command)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    elapsed = time.perf_counter() - start
    if trace is not None:
        trace.write(args.kv_trace)
    engine = llm.engine
    stats, snap = engine.stats, engine.snapshot()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    summary = {
        "requests": len(outputs),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "seconds": round(elapsed, 3),
        "generated_tokens_per_s": round(generated / elapsed, 2),
        "peak_blocks_in_use": stats.peak_used_blocks,
        "kv_blocks_total": snap.usage.num_blocks,
        "mean_kv_utilization": round(stats.mean_utilization, 4),
        "preemptions": snap.num_preemptions,
        "prefix_cache_hit_rate": round(snap.prefix_hit_rate, 4),
    }
    if engine.config.speculative_config is not None:
        summary["spec_acceptance_rate"] = round(snap.spec_acceptance_rate, 4)
        summary["spec_mean_accepted_length"] = round(snap.spec_mean_accepted_length, 3)
    if args.json:
        print(
            json.dumps(
                {
                    "outputs": [[c.text for c in o.outputs] for o in outputs],
                    "summary": summary,
                },
                indent=2,
            )
        )
        return 0
    for i, out in enumerate(outputs):
        for c in out.outputs:
            label = f"[{i}]" if len(out.outputs) == 1 else f"[{i}.{c.index}]"
            print(f"{label} {c.text.strip()}")
    print(
        f"\n{summary['requests']} requests, {prompt_tokens} prompt + {generated} generated "
        f"tokens in {elapsed:.2f} s ({summary['generated_tokens_per_s']} generated tokens/s); "
        f"peak {stats.peak_used_blocks}/{snap.usage.num_blocks} KV blocks in use, "
        f"mean KV utilisation {stats.mean_utilization:.1%}, "
        f"{snap.num_preemptions} preemptions"
        + (
            f"; speculation: {snap.spec_acceptance_rate:.1%} of proposed tokens accepted, "
            f"{snap.spec_mean_accepted_length:.2f} tokens per checking step"
            if engine.config.speculative_config is not None
            else ""
        )
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm", description="LLM inference with a paged KV cache (PagedAttention)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_kv_view_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    _log_to_stderr()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # the command as given, for records of the run (a KV trace's)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagedllm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _log_to_stderr() -> None:
    """The engine's log lines (the KV pool at start, ...) on stderr; a library import
    leaves logging to the application."""
    log = logging.getLogger("pagedllm")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s pagedllm: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
