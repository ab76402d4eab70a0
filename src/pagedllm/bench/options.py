"""The benches' command-line options, each declared once, and what a run is built from.

`add_bench_args` adds `--out`, `--seed`, the workload options and the engine options
(entrypoints/engine_args.py) with a bench's defaults; `engine_kwargs` resolves the KV
budget into blocks: `--num-kv-blocks`, else `--kv-cache-memory`, else `--kv-cache-tokens`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pagedllm.bench import workload as wl
from pagedllm.bench.datasets import copy_requests, sharegpt_requests
from pagedllm.core.reservation import check_policy
from pagedllm.engine.config import parse_size
from pagedllm.entrypoints.engine_args import add_engine_args, engine_options
from pagedllm.errors import InvalidParameterError
from pagedllm.kv.block_table import check_block_size
from pagedllm.kv.groups import group_layers, group_size
from pagedllm.loader import LoadedModel, load_model

# Two max_model_len=2048 reservations plus the 1% admission watermark, in blocks of 16:
# small enough that reserve-max is memory-bound, as in the vLLM paper's setting.
DEFAULT_KV_TOKENS = 4224
DEFAULT_MAX_MODEL_LEN = 2048


# List options: argparse turns a ValueError raised here (the engine's own rules raise them)
# into a one-line usage error.
def int_list(text: str) -> list[int]:
    """A comma list of integers, such as `1,8,16`."""
    return [int(x) for x in text.split(",")]


def int_range(text: str) -> tuple[int, int]:
    lo, hi = text.split(":")
    return int(lo), int(hi)


def choice_list(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of names from `choices` (`what` names them in the
    error, and in argparse's own message)."""

    def parse(text: str) -> list[str]:
        names = text.split(",")
        for name in names:
            if name not in choices:
                raise ValueError(f"unknown {what} {name!r}: choose from {', '.join(choices)}")
        return names

    parse.__name__ = f"{what} list"
    return parse


def policies(text: str) -> list[str]:
    """A comma list of KV reservation policies, or `none`."""
    names = [] if text == "none" else text.split(",")
    for name in names:
        check_policy(name)
    return names


def add_bench_args(
    p: argparse.ArgumentParser,
    name: str,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    workload: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
) -> None:
    """`--out` and `--seed`; the workload options with `workload` as their defaults; the
    engine options with `engine` as theirs (and, with a workload, the KV budget); `run`."""
    p.add_argument("--out", default=f"bench-out/{name}", help="folder for JSON, Markdown, PNG")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    if workload is not None:  # dests are WorkloadSpec's fields
        w = p.add_argument_group("workload")
        w.add_argument("--workload", dest="kind", default="sharegpt", choices=wl.WORKLOADS)
        w.add_argument("--num-prompts", type=int, help="default: %(default)s")
        w.add_argument("--prompt-len", type=int, default=128, help="fixed workload")
        w.add_argument("--output-len", type=int, default=128, help="fixed workload")
        w.add_argument("--prompt-range", type=int_range, default=(32, 256), help="uniform: LO:HI")
        w.add_argument("--output-range", type=int_range, default=(32, 256), help="uniform: LO:HI")
        scale = "sharegpt: fraction of ShareGPT's mean lengths (161 in, 338 out)"
        w.add_argument("--sharegpt-scale", dest="scale", type=float, default=0.5, help=scale)
        dataset = (
            "real prompts, not --workload: sharegpt (--dataset-path), or copy (chat prompts "
            "asking to repeat paragraphs of the shipped text; --output-len tokens each)"
        )
        w.add_argument("--dataset", choices=["sharegpt", "copy"], help=dataset)
        w.add_argument("--dataset-path", help="the dataset's file (ShareGPT JSON)")
        rate = "Poisson arrivals per second (per step in a bookkeeping run); default: all at once"
        w.add_argument("--request-rate", type=float, help=rate)
    if engine is not None:
        add_engine_args(p, **engine)
    if engine is not None and workload is not None:
        budget = "KV pool in tokens (default: %(default)s); --kv-cache-memory overrides it"
        p.add_argument("--kv-cache-tokens", type=int, default=DEFAULT_KV_TOKENS, help=budget)
    # Last: set_defaults only reaches the options added before it.
    p.set_defaults(func=run, **(workload or {}))


def sweep_values(args: argparse.Namespace, many: str, one: str, default: list[Any]) -> list[Any]:
    """What a bench sweeps: the list option `many` if given, else the engine option `one`
    if given (a sweep of one), else the bench's default list."""
    listed, single = getattr(args, many), getattr(args, one)
    if listed is not None and single is not None:
        flags = [f"--{x.replace('_', '-')}" for x in (many, one)]
        raise InvalidParameterError(one, f"give {flags[0]} or {flags[1]}, not both")
    return list(listed if listed is not None else default if single is None else [single])


@functools.cache  # `bench report` runs five benches on one model
def get_loaded(path: str | None) -> LoadedModel:
    """The model, dequantized (config, tokenizer, the transformers baseline); an engine the
    bench builds over it decides quantization "auto" for the model's file, as `serve`
    would, and loads the file's blocks again for gguf (sweep.engine_over_runner)."""
    return load_model(path)


def kv_bytes_per_token(loaded: LoadedModel, opts: dict[str, Any]) -> int:
    dtype = opts.get("kv_cache_dtype", "auto")  # auto: the model's dtype
    dtype = opts["dtype"] if dtype == "auto" else dtype
    return loaded.config.kv_bytes_per_token(getattr(torch, dtype).itemsize)


def blocks_per_full_block(loaded: LoadedModel, opts: dict[str, Any]) -> int:
    """Pool blocks in the bytes of one block of every layer: layers / layers per group
    (1 for a model of one kind, or with the hybrid manager disabled)."""
    cfg = loaded.config
    hybrid = not opts.get("disable_hybrid_kv_cache_manager", False)
    groups = group_layers(cfg.layer_windows, cfg.num_hidden_layers, hybrid)
    return cfg.num_hidden_layers // group_size(groups)


def kv_budget_tokens(loaded: LoadedModel, opts: dict[str, Any]) -> int:
    """The pool's bytes in tokens of every layer (what `--kv-cache-tokens` gives)."""
    return opts["num_kv_blocks"] * opts["block_size"] // blocks_per_full_block(loaded, opts)


def engine_kwargs(args: argparse.Namespace, loaded: LoadedModel, **overrides: Any) -> dict:
    """EngineConfig keywords for one run: the engine options, then `overrides` (a swept
    policy or block size), with the KV budget in blocks and max_model_len resolved."""
    opts = {**engine_options(args), **overrides}
    bs, memory = opts["block_size"], opts.pop("kv_cache_memory")
    check_block_size(bs)  # before it divides the budget; EngineConfig would check it later
    tokens = args.kv_cache_tokens
    if memory is not None:
        tokens = parse_size(memory) // kv_bytes_per_token(loaded, opts)
    # A budget of `tokens` tokens of every layer; with layer groups a block holds one
    # group's layers, so the same bytes make more blocks.
    blocks = opts["num_kv_blocks"] or tokens // bs * blocks_per_full_block(loaded, opts)
    context = loaded.config.max_position_embeddings
    max_len = opts["max_model_len"] or min(DEFAULT_MAX_MODEL_LEN, context)
    if (blocks - 1) * bs < max_len:
        raise InvalidParameterError(
            "kv_cache_tokens",
            f"the KV budget ({blocks * bs} tokens) must hold one max_model_len ({max_len}) "
            "request plus a block; raise --kv-cache-tokens or lower --max-model-len",
        )
    return {**opts, "num_kv_blocks": blocks, "max_model_len": max_len}


def workload_of(
    args: argparse.Namespace, vocab_size: int, max_len: int, tokenizer: Any = None
) -> list[wl.BenchRequest]:
    """The synthetic `--workload`, or `--dataset` prompts (tokenized with `tokenizer`)."""
    if args.dataset == "copy":
        if tokenizer is None:
            raise InvalidParameterError("dataset", "--dataset copy needs a model with a tokenizer")
        requests = copy_requests(tokenizer, args.num_prompts, args.output_len)
    elif args.dataset is not None:
        if not args.dataset_path or tokenizer is None:
            needs = "--dataset-path FILE" if not args.dataset_path else "a model with a tokenizer"
            raise InvalidParameterError("dataset_path", f"--dataset {args.dataset} needs {needs}")
        requests = sharegpt_requests(
            args.dataset_path, tokenizer, args.num_prompts, args.seed, max_len
        )
    else:
        spec = {f.name: getattr(args, f.name) for f in dataclasses.fields(wl.WorkloadSpec)}
        requests = wl.make_workload(wl.WorkloadSpec(**spec), vocab_size, max_len)
    if args.request_rate is not None:
        requests = wl.with_poisson_arrivals(requests, args.request_rate, args.seed)
    return requests


def prepare(
    name: str, args: argparse.Namespace, **overrides: Any
) -> tuple[LoadedModel, dict[str, Any], list[wl.BenchRequest], dict[str, Any]]:
    """A workload bench's start: the model, its engine options, requests and result."""
    loaded = get_loaded(args.model)
    opts = engine_kwargs(args, loaded, **overrides)
    vocab, max_len = loaded.config.vocab_size, opts["max_model_len"]
    requests = workload_of(args, vocab, max_len, loaded.tokenizer)
    blocks, bs = opts["num_kv_blocks"], opts["block_size"]
    tokens = kv_budget_tokens(loaded, opts)
    mib = round(tokens * kv_bytes_per_token(loaded, opts) / 2**20, 1)
    config = {"block_size": bs, "kv_tokens": tokens, "kv_blocks": blocks, "kv_mib": mib}
    config |= {k: opts[k] for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")}
    return loaded, opts, requests, new_result(name, args, loaded, config, requests=requests)


def new_result(
    name: str,
    args: argparse.Namespace,
    model: LoadedModel | str,
    config: dict[str, Any],
    rows: list[dict[str, Any]] | None = None,
    notes: list[str] | None = None,
    requests: list[wl.BenchRequest] | None = None,
) -> dict[str, Any]:
    """The result every bench fills: command, config, machine, workload, rows and notes."""
    if isinstance(model, LoadedModel):
        model = os.path.basename(model.source.rstrip("/"))
    workload = None
    if requests:
        kind = f"{args.dataset} ({args.dataset_path})" if args.dataset else args.kind
        workload = {"kind": kind, "seed": args.seed, **wl.summarize(requests)}
        workload |= {"sharegpt_scale": args.scale} if kind == "sharegpt" else {}
        workload |= {"request_rate": args.request_rate} if args.request_rate else {}
    # The command that reproduces the run: `bench report` sets argv for its suite; a bench
    # called in-process (tests) is named by its subcommand.
    argv = getattr(args, "argv", None)
    if argv is None:
        argv = sys.argv[1:] if sys.argv[1:2] == ["bench"] else ["bench", args.bench_command]
    environment = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (active spinning)"),
        # Other work shares the cores: absolute figures depend on the load.
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
    }
    result = {"bench": name, "command": "pagedllm " + shlex.join(argv)}
    result |= {"config": {"model": model, **config}, "environment": environment}
    result |= {"workload": workload, "results": rows or [], "ratios": {}, "notes": notes or []}
    return result
