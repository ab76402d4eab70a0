"""`pagedllm bench serve`: load-test a running OpenAI-compatible server like `vllm bench
serve`. It streams the workload's completions at a Poisson `--request-rate` and/or under
`--max-concurrency`, then reports requests/s, tokens/s, and the mean, median and p99 of
the latency to the first token (TTFT), per later token (TPOT), between chunks (ITL) and
end to end (E2EL). With `--compare-url` the identical load then goes to a second
OpenAI-compatible server (llama.cpp's `llama-server`, vLLM, ...) and both are printed side
by side with their ratios; `--rounds N` cuts the load into N parts that alternate between
the two servers, so that a machine whose speed drifts (shared cores) weighs on both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
from contextlib import aclosing
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pagedllm.bench import options
from pagedllm.bench.output import Plot, cdf, distribution, write_outputs
from pagedllm.bench.sse_client import REQUEST_ERRORS, LoadClient, load_client
from pagedllm.bench.workload import BenchRequest
from pagedllm.errors import InvalidParameterError
from pagedllm.loader.tokenizer import load_tokenizer

TOKEN_ID_RANGE = (1000, 20000)  # ordinary vocabulary entries of any ~32k+ tokenizer
WORDS = ["the", "model", "cache", "block", "token", "memory", "paged", "attention", "river"]
WORDS += ["stone", "light", "quiet", "green", "number", "system", "world", "time", "table"]


@dataclass
class RequestResult:
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunks: list[float] = field(default_factory=list)  # when each chunk came, after sending
    latency: float = 0.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="load-test a running OpenAI-compatible server")
    workload = {"num_prompts": 32, "kind": "fixed", "output_len": 64}
    options.add_bench_args(p, "serve", run, workload)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", help="model name (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"))
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    kinds = ["token-ids", "words"]
    p.add_argument("--prompt-kind", choices=kinds, default=kinds[0], help="words: ~1 token each")
    text = "seconds a request may wait for its answer's next bytes"
    p.add_argument("--timeout", type=float, default=600.0, help=text)
    p.add_argument("--tokenizer", help="model whose tokenizer measures --dataset prompts")
    p.add_argument("--compare-url", help="then send the identical load to this server too")
    text = "with --compare-url: cut the load into this many parts, alternating between servers"
    p.add_argument("--rounds", type=int, default=1, help=text)


async def send_one(client: LoadClient, body: dict[str, Any]) -> RequestResult:
    res, start = RequestResult(), time.perf_counter()
    try:
        async with aclosing(client.stream("/v1/completions", body)) as chunks:
            async for chunk in chunks:
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                usage = chunk.get("usage") or {}
                res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                res.output_tokens = usage.get("completion_tokens", res.output_tokens)
                if chunk.get("choices"):
                    res.chunks.append(time.perf_counter() - start)
        res.latency = time.perf_counter() - start
        res.error = "" if res.chunks else "no tokens streamed"
    except REQUEST_ERRORS as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


@dataclass
class LoadRun:
    """A load against one server (or parts of it, added up): each request's result, the
    wall seconds, the load generator's own CPU seconds (all its threads: on the server's
    cores it is CPU taken from the server), and the model the requests named."""

    results: list[RequestResult] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    model: str = ""

    def add(self, other: LoadRun) -> None:
        self.results.extend(other.results)
        self.seconds += other.seconds
        self.cpu_seconds += other.cpu_seconds
        self.model = other.model


async def run_load(args: argparse.Namespace, url: str, requests: list[BenchRequest]) -> LoadRun:
    """Every request sent at its arrival time."""
    connections = max(100, len(requests))
    async with load_client(url, args.api_key, connections, args.timeout) as client:
        model = args.model if url == args.url else None
        if model is None:  # the server's first model
            model = await client.first_model()
        gate = asyncio.Semaphore(args.max_concurrency or len(requests))
        rng, start, cpu = random.Random(args.seed), time.perf_counter(), time.process_time()

        async def one(r: BenchRequest) -> RequestResult:
            # The server's vocabulary is unknown here: ids move into TOKEN_ID_RANGE.
            prompt: Any = [TOKEN_ID_RANGE[0] + t for t in r.prompt_token_ids]
            if r.prompt_text is not None:  # a dataset's: the server tokenizes it
                prompt = r.prompt_text
            elif args.prompt_kind == "words":
                prompt = " ".join(rng.choice(WORDS) for _ in prompt)
            body = {"model": model, "prompt": prompt, "max_tokens": r.output_len, "temperature": 0}
            body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            await asyncio.sleep(r.arrival_time - (time.perf_counter() - start))
            async with gate:
                return await send_one(client, body)

        results = await asyncio.gather(*map(one, requests))
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        return LoadRun(list(results), seconds, cpu_seconds, model)


def measure(args: argparse.Namespace, url: str, requests: list[BenchRequest]) -> dict[str, Any]:
    """One server's figures under the load: a summary, latency rows, errors, requests."""
    return summarize(url, asyncio.run(run_load(args, url, requests)))


def alternate(
    args: argparse.Namespace, requests: list[BenchRequest]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The load in `args.rounds` consecutive parts, each sent to --url and then to
    --compare-url (arrivals counted from the part's first); both servers' figures over
    all their parts."""
    size = -(-len(requests) // args.rounds)
    urls = (args.url, args.compare_url)
    runs = (LoadRun(), LoadRun())
    for first in range(0, len(requests), size):
        part = requests[first : first + size]
        part = [replace(r, arrival_time=r.arrival_time - part[0].arrival_time) for r in part]
        for side, url in enumerate(urls):
            runs[side].add(asyncio.run(run_load(args, url, part)))
    return summarize(urls[0], runs[0]), summarize(urls[1], runs[1])


def summarize(url: str, run: LoadRun) -> dict[str, Any]:
    """The figures of a load's results."""
    results, seconds = run.results, run.seconds
    ok = [r for r in results if not r.error]
    inputs, outputs = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    summary = {"url": url, "model": run.model, "completed": len(ok)}
    summary |= {"failed": len(results) - len(ok), "duration_s": seconds}
    summary |= {"total_input_tokens": inputs, "total_output_tokens": outputs}
    rates = {"request": len(ok), "output": outputs, "total_token": inputs + outputs}
    summary |= {f"{k}_throughput": v / seconds for k, v in rates.items()}
    summary["client_cpu_ms_per_token"] = 1000 * run.cpu_seconds / outputs if outputs else None
    tpot = [(r.latency - r.chunks[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    times = {"TTFT": [r.chunks[0] for r in ok], "TPOT": tpot}
    times["ITL"] = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:], strict=False)]
    times["E2EL"] = [r.latency for r in ok]
    rows = [
        {"metric": name, **distribution([1000 * v for v in values], "_ms", digits=2)}
        for name, values in times.items()
    ]
    errors = sorted({r.error for r in results if r.error})[:10]
    return {"summary": summary, "rows": rows, "times": times, "errors": errors, "results": results}


def comparison(ours: dict[str, Any], theirs: dict[str, Any]) -> list[dict[str, Any]]:
    """The headline figures of both servers side by side, with ours / theirs."""
    rows = []
    for key, label in (("output_throughput", "output tok/s"), ("request_throughput", "req/s")):
        a, b = ours["summary"][key], theirs["summary"][key]
        rows.append({"metric": label, "ours": a, "theirs": b, "ratio": a / b if b else None})
    for mine, other in zip(ours["rows"], theirs["rows"], strict=True):
        for stat in ("mean", "median", "p99"):
            a, b = mine[f"{stat}_ms"], other[f"{stat}_ms"]
            ratio = a / b if a is not None and b else None
            rows.append(
                {"metric": f"{mine['metric']} {stat} ms", "ours": a, "theirs": b, "ratio": ratio}
            )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    rate, cap = args.request_rate, args.max_concurrency
    if (rate, cap) == (None, None) or (rate or 1) <= 0 or (cap or 1) < 1:
        message = "give --request-rate > 0 (or inf) and/or --max-concurrency >= 1"
        raise InvalidParameterError("request_rate", message)
    # The server's context is unknown here: sharegpt lengths are clipped to 2048 tokens.
    span = TOKEN_ID_RANGE[1] - TOKEN_ID_RANGE[0]
    tokenizer = load_tokenizer(args.tokenizer) if args.dataset else None
    requests = options.workload_of(args, span, options.DEFAULT_MAX_MODEL_LEN, tokenizer)
    if not 1 <= args.rounds <= len(requests):
        message = f"rounds must be between 1 and the number of requests ({len(requests)})"
        raise InvalidParameterError("rounds", f"{message}, got {args.rounds}")
    if args.rounds > 1 and not args.compare_url:
        message = "rounds alternate the load between --url and --compare-url: give --compare-url"
        raise InvalidParameterError("rounds", message)
    if args.compare_url:
        ours, theirs = alternate(args, requests)
    else:
        ours = measure(args, args.url, requests)
    config = {"url": args.url, "request_rate": rate or math.inf, "max_concurrency": cap}
    if args.compare_url:
        config |= {"compare_url": args.compare_url, "rounds": args.rounds}
    result = options.new_result("serve", args, ours["summary"]["model"], config, requests=requests)
    result["summary"], result["results"] = ours["summary"], ours["rows"]
    result["latency"] = ours["rows"]  # kept when `results` becomes a comparison
    result["errors"] = ours["errors"]
    result["requests"] = [asdict(r) for r in ours["results"]]
    result["notes"].append(
        f"prompts: {args.prompt_kind}; TTFT from sending to the first streamed chunk; TPOT = "
        "(E2EL - TTFT) / (output tokens - 1); ITL: gaps between streamed chunks; "
        "client_cpu_ms_per_token: this load generator's own CPU (all its threads) per output "
        "token, which on the server's cores is taken from the server"
    )
    curves = {"TTFT": cdf(ours["times"]["TTFT"]), "E2EL": cdf(ours["times"]["E2EL"])}
    columns = "metric=metric|mean_ms=mean|median_ms=median|p99_ms=p99 (ms)"
    if args.compare_url:  # the identical load, against the other server
        result["compared"] = {k: theirs[k] for k in ("summary", "rows", "errors")}
        result["results"] = comparison(ours, theirs)
        result["ratios"] = {"output_throughput": result["results"][0]["ratio"]}
        curves |= {f"{k} (other)": cdf(theirs["times"][k]) for k in ("TTFT", "E2EL")}
        columns = "metric=metric|ours=ours|theirs=other server|ratio=ours / other"
        result["errors"] += [f"other server: {e}" for e in theirs["errors"]]
    plots = [Plot("latency_cdf", "Request latency", "seconds", "fraction of requests", curves)]
    write_outputs(result, args.out, columns, plots)
    for error in result["errors"]:
        print(f"error: {error}", file=sys.stderr)
    return result | {"exit_code": 0 if ours["summary"]["completed"] else 1}
