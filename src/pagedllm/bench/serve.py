"""`pagedllm bench serve`: a load generator for a running OpenAI-compatible server.

Sends `--num-prompts` streaming completion requests (prompts of random token ids, or of
random words, so no dataset is needed) at a Poisson `--request-rate` and/or under a
`--max-concurrency` cap, then prints requests/s, tokens/s, time to first token (TTFT),
time per output token (TPOT), inter-token latency (ITL) and end-to-end latency (mean,
median, p99) like `vllm bench serve`, and writes them as JSON with `--out`.
Register it with `add_serve_bench_parser(bench_subparsers)`; run alone with
`python -m pagedllm.bench.serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

TOKEN_ID_RANGE = (1000, 20000)  # ordinary vocabulary entries of any ~32k+ tokenizer
WORDS = (
    "the",
    "model",
    "cache",
    "block",
    "token",
    "memory",
    "paged",
    "attention",
    "river",
    "stone",
    "light",
    "quiet",
    "green",
    "number",
    "system",
    "world",
    "time",
    "table",
)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def add_serve_bench_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("serve", help="load-test a running OpenAI-compatible server")
    add_serve_bench_args(p)
    p.set_defaults(func=run_serve_bench)
    return p


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals per second ('inf': all at once)",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    p.add_argument(
        "--prompt-kind",
        choices=["token-ids", "words"],
        default="token-ids",
        help="random token ids (exact length) or random words (about one token each)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def make_prompts(kind: str, num: int, length: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    if kind == "token-ids":
        return [[rng.randrange(*TOKEN_ID_RANGE) for _ in range(length)] for _ in range(num)]
    return [" ".join(rng.choice(WORDS) for _ in range(length)) for _ in range(num)]


async def send_one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
    res = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = res.ttft > 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_load(args: argparse.Namespace) -> tuple[list[RequestResult], float, str]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(100, args.num_prompts))
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        prompts = make_prompts(args.prompt_kind, args.num_prompts, args.input_len, args.seed)
        rng = random.Random(args.seed + 1)
        rate = args.request_rate if args.request_rate is not None else math.inf
        gate = asyncio.Semaphore(args.max_concurrency or args.num_prompts)

        async def one(prompt: Any) -> RequestResult:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                return await send_one(client, "/v1/completions", body)

        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            if i and rate != math.inf:
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start, model


def _stats(name: str, values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values) or [0.0]
    p99 = ms[min(len(ms) - 1, math.ceil(0.99 * len(ms)) - 1)]
    return {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"p99_{name}_ms": p99,
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    inputs = sum(r.prompt_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
    }
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary |= _stats("ttft", [r.ttft for r in ok]) | _stats("tpot", tpot)
    summary |= _stats("itl", [x for r in ok for x in r.itl])
    summary |= _stats("e2el", [r.latency for r in ok])
    errors = sorted({r.error for r in results if not r.ok})
    summary["errors"] = errors[:10]
    return summary


def format_table(s: dict[str, Any]) -> str:
    rows = [
        ("=", " Serving Benchmark Result "),
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Benchmark duration (s):", s["duration_s"]),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", s["request_throughput"]),
        ("Output token throughput (tok/s):", s["output_throughput"]),
        ("Total token throughput (tok/s):", s["total_token_throughput"]),
    ]
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        rows.append(("-", f"{title}"))
        for stat in ("mean", "median", "p99"):
            rows.append(
                (
                    f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms):",
                    s[f"{stat}_{key}_ms"],
                )
            )
    lines = []
    for label, value in rows:
        if label in ("=", "-"):
            lines.append(f"{value:{label}^50}")
        else:
            text = f"{value:.2f}" if isinstance(value, float) else str(value)
            lines.append(f"{label:<40}{text}")
    lines.append("=" * 50)
    return "\n".join(lines)


def run_serve_bench(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if args.request_rate is None and args.max_concurrency is None:
        raise ValueError("give --request-rate or --max-concurrency (or both)")
    if args.request_rate is not None and args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    results, duration, model = asyncio.run(run_load(args))
    summary = summarize(results, duration)
    print(format_table(summary))
    for error in summary["errors"]:
        print(f"error: {error}", file=sys.stderr)
    if args.out:
        config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "config": {**config, "model": model},
                    "results": summary,
                    "requests": [asdict(r) for r in results],
                },
                f,
                indent=2,
            )
    return 0 if summary["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedllm bench serve", description=__doc__)
    add_serve_bench_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_serve_bench(args)
    except ValueError as exc:
        print(f"pagedllm bench serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
