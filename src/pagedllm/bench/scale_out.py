"""`pagedllm bench scale-out`: engine replicas on Ray Serve under a multi-turn chat load,
routed by cached prefix (`prefix`) or by Ray's power of two choices (`pow2`), against
one replica holding the replicas' KV memory together (`single`).

Each system is deployed on a local Ray cluster in turn (`--num-replicas` replicas of
`--replica-cpus` CPUs; `single` gets the KV blocks of them all, and `--single-cpus`,
one replica's by default) and serves the same conversations (bench/conversations.py)
through the OpenAI endpoint of `pagedllm serve --ray` (bench/chat_load.py plays them):
every conversation at once, each turn streamed after the one before. Figures per
system: the prefix cache's hit rate (usage.prompt_tokens_details.cached_tokens over
prompt tokens), the prompt tokens computed, TTFT and throughput. Needs the `ray` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import sys
from typing import Any

from pagedllm.bench import options
from pagedllm.bench.chat_load import drive, warm_up
from pagedllm.bench.conversations import (
    ChatWorkloadSpec,
    Conversation,
    TurnRecord,
    load_texts,
    make_conversations,
    summarize,
)
from pagedllm.bench.output import ratio, write_outputs
from pagedllm.engine.config import parse_size
from pagedllm.entrypoints.engine_args import engine_options
from pagedllm.errors import InvalidParameterError

SYSTEMS = ("prefix", "pow2", "single")
SERVED_NAME = "bench"
COLUMNS = "|".join(
    [
        "system=system",
        "replicas=replicas",
        "kv_blocks_per_replica=KV blocks/replica",
        "turns=turns",
        "prompt_tokens=prompt tokens",
        "cached_tokens=cached",
        "computed_tokens=computed",
        "hit_rate=hit rate",
        "later_turn_hit_rate=later-turn hit rate",
        "hit_rate_vs_single=hit rate vs single",
        "computed_vs_pow2=pow2 computed / this",
        "ttft_mean_ms=TTFT mean ms",
        "ttft_p99_ms=TTFT p99 ms",
        "output_throughput=output tok/s",
        "duration_s=s",
    ]
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("scale-out", help="Ray Serve replicas: prefix vs pow2 routing, multi-turn")
    options.add_bench_args(p, "scale-out", run, engine={"num_kv_blocks": 512})
    systems = options.choice_list(SYSTEMS, "system")
    p.add_argument("--systems", type=systems, default=list(SYSTEMS), help="comma list")
    p.add_argument("--num-replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    p.add_argument("--single-cpus", type=float, help="single's CPUs (default: --replica-cpus)")
    p.add_argument("--max-imbalance", type=int, default=4, help="prefix router's")
    w = p.add_argument_group("chat workload")
    w.add_argument("--conversations", type=int, default=ChatWorkloadSpec.conversations)
    w.add_argument("--turns", type=int, default=ChatWorkloadSpec.turns)
    w.add_argument("--passage-words", type=int, default=ChatWorkloadSpec.passage_words)
    w.add_argument("--output-len", type=int, default=ChatWorkloadSpec.output_len, help="max")
    p.add_argument("--max-concurrency", type=int, help="conversations at once (default: all)")
    p.add_argument("--port", type=int, default=0, help="Serve's HTTP port (default: a free one)")
    p.add_argument("--route-prefix", default="/", help="where each system is served")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per turn")


# ------------------------------------------------------------------ the systems
def engine_kwargs(args: argparse.Namespace, share: int) -> dict[str, Any]:
    """The engine options of one replica holding `share` replicas' KV memory."""
    opts = engine_options(args)
    if opts["num_kv_blocks"] is not None:
        opts["num_kv_blocks"] *= share
    else:
        opts["kv_cache_memory"] = parse_size(opts["kv_cache_memory"]) * share
    return opts


def replica_threads(app_name: str) -> list[int]:
    """torch's thread count in each engine replica of the application."""
    import ray

    actors = [
        ray.get_actor(a["name"], namespace="serve")
        for a in ray.util.list_named_actors(all_namespaces=True)
        if f"{app_name}#EngineReplica" in a["name"]
    ]
    calls = [a.__ray_call__.remote(lambda _: __import__("torch").get_num_threads()) for a in actors]
    return [int(n) for n in ray.get(calls, timeout=60)]


def measure_system(
    system: str, args: argparse.Namespace, port: int, conversations: list[Conversation]
) -> tuple[dict[str, Any], list[TurnRecord]]:
    """Deploy `system`, run the conversations through it, take it down."""
    from ray import serve

    from pagedllm.engine.config import EngineConfig
    from pagedllm.entrypoints.ray_serve.app import RayServeOptions, RouterOptions, build_app

    n = args.num_replicas
    share = n if system == "single" else 1
    replicas = 1 if system == "single" else n
    cpus = args.replica_cpus
    if system == "single" and args.single_cpus:
        cpus = args.single_cpus
    config = EngineConfig(**engine_kwargs(args, share))
    serve_options = RayServeOptions(
        num_replicas=replicas,
        routing="prefix" if system == "prefix" else "pow2",
        router=RouterOptions(max_imbalance=args.max_imbalance),
        replica_actor_options={"num_cpus": cpus},
    )
    app_name = f"scale-out-{system}"
    serve.run(
        build_app(config, serve_options, served_model_name=SERVED_NAME),
        name=app_name,
        route_prefix=args.route_prefix,
    )
    url = f"http://127.0.0.1:{port}{args.route_prefix.rstrip('/')}"
    try:
        threads = replica_threads(app_name)
        asyncio.run(warm_up(url, SERVED_NAME, 2 * replicas))
        records, seconds = asyncio.run(
            drive(url, conversations, args.output_len, None, args.max_concurrency, args.timeout)
        )
    finally:
        serve.delete(app_name)
    row = summarize(
        system,
        records,
        seconds,
        replicas=replicas,
        kv_blocks_per_replica=config.num_kv_blocks,
        cpus_per_replica=cpus,
        torch_threads_per_replica=max(threads, default=None),
    )
    return row, records


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_comparisons(result: dict[str, Any]) -> None:
    """Each row's hit rate over single's, and pow2's computed prompt tokens over its."""
    rows = {r["system"]: r for r in result["results"]}
    single, pow2 = rows.get("single"), rows.get("pow2")
    for row in rows.values():
        row["hit_rate_vs_single"] = ratio(row["hit_rate"], single and single["hit_rate"])
        row["computed_vs_pow2"] = ratio(pow2 and pow2["computed_tokens"], row["computed_tokens"])
        result["ratios"][row["system"]] = {
            k: row[k] for k in ("hit_rate_vs_single", "computed_vs_pow2")
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    if args.num_replicas < 1 or args.replica_cpus < 0:
        raise InvalidParameterError("num_replicas", "give --num-replicas >= 1, --replica-cpus >= 0")
    spec = ChatWorkloadSpec(
        args.conversations, args.turns, args.passage_words, args.output_len, args.seed
    )
    conversations = make_conversations(spec, *load_texts())
    model = os.path.basename((args.model or "SmolLM2-135M-Instruct (default)").rstrip("/"))
    config = {"num_replicas": args.num_replicas, "replica_cpus": args.replica_cpus}
    config |= {"block_size": args.block_size, "max_imbalance": args.max_imbalance}
    result = options.new_result("scale-out", args, model, config)  # the load before the run
    started = not ray.is_initialized()
    if started:  # a cluster of just the replicas' CPUs
        cpus = math.ceil(max(args.num_replicas * args.replica_cpus, args.single_cpus or 0, 1))
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    port = args.port or free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows, records = [], {}
    try:
        for system in args.systems:
            row, records[system] = measure_system(system, args, port, conversations)
            rows.append(row)
            print(f"  {system}: hit rate {row['hit_rate']}, computed {row['computed_tokens']}")
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()
    result["results"] = rows
    result["environment"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["workload"] = {
        "conversations": spec.conversations,
        "turns": spec.turns,
        "passage_words": spec.passage_words,
        "output_len": spec.output_len,
        "seed": spec.seed,
    }
    add_comparisons(result)
    result["records"] = {s: [vars(r) for r in rs] for s, rs in records.items()}
    result["errors"] = sorted({r.error for rs in records.values() for r in rs if r.error})[:10]
    result["notes"] += [
        "every turn resends the whole conversation; all conversations run at once, greedy",
        "hit rate: prompt tokens served from a prefix cache (usage.prompt_tokens_details."
        "cached_tokens) over all prompt tokens; computed = prompt - cached",
        "single: one replica with the KV blocks of all the replicas together"
        + (f" and {args.single_cpus} CPUs" if args.single_cpus else ", and one replica's CPUs"),
        "later-turn hit rate: over the turns after each conversation's first",
        "TTFT: from sending a turn to its first streamed text",
    ]
    write_outputs(result, args.out, COLUMNS)
    for error in result["errors"]:
        print(f"error: {error}", file=sys.stderr)
    failed = any(r["failed"] or not r["turns"] for r in rows)
    return result | {"exit_code": 1 if failed else 0}
