"""What every bench shares: command-line options, the KV budget, the loaded model, the
workload, and a note of the machine and what else was running on it.

The KV budget is given in tokens (`--kv-cache-tokens`, default 4224 = 264 blocks of 16:
two `max_model_len`=2048 reservations plus the 1% admission watermark) or in bytes
(`--kv-cache-memory`); the same budget is used for every policy and backend.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.bench.workload import WORKLOADS, BenchRequest, WorkloadSpec, make_workload
from pagedllm.core.reservation import RESERVATION_POLICIES as KV_RESERVATIONS
from pagedllm.engine.config import parse_size
from pagedllm.loader import LoadedModel, load_model

DEFAULT_KV_TOKENS = 4224
DEFAULT_MAX_MODEL_LEN = 2048
_LOADED: dict[str | None, LoadedModel] = {}


def range_arg(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None
    return lo, hi


def policies_arg(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in KV_RESERVATIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"policies must be a comma list of {', '.join(KV_RESERVATIONS)}; got {text!r}"
        )
    return names


def add_common_args(p: argparse.ArgumentParser, num_prompts: int, out: str) -> None:
    g = p.add_argument_group("model and KV budget")
    g.add_argument("--model", default=None, help="a .gguf file or HF directory (default SmolLM2)")
    g.add_argument("--out", default=out, help="folder for the JSON, Markdown and PNG outputs")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help=f"KV pool in tokens (default {DEFAULT_KV_TOKENS})",
    )
    g.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV pool in bytes, e.g. 200MiB (instead of --kv-cache-tokens)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"context limit (default min({DEFAULT_MAX_MODEL_LEN}, the model's))",
    )
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="sharegpt", choices=WORKLOADS)
    w.add_argument("--num-prompts", type=int, default=num_prompts)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prompt-len", type=int, default=128, help="fixed workload")
    w.add_argument("--output-len", type=int, default=128, help="fixed workload")
    w.add_argument("--prompt-range", type=range_arg, default=(32, 256), help="uniform: LO:HI")
    w.add_argument("--output-range", type=range_arg, default=(32, 256), help="uniform: LO:HI")
    w.add_argument(
        "--sharegpt-scale",
        type=float,
        default=0.5,
        help="sharegpt: fraction of ShareGPT's mean lengths (161 in, 338 out)",
    )


@dataclass(frozen=True)
class BenchSettings:
    """The engine options a bench holds fixed across policies."""

    block_size: int
    num_kv_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def engine_options(self, policy: str) -> dict[str, Any]:
        return dict(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=False,  # random prompts share nothing; keep it like-for-like
            kv_reservation=policy,
            seed=0,
        )


def get_loaded(path: str | None) -> LoadedModel:
    """Load a model once per process (loading the default GGUF takes seconds)."""
    if path not in _LOADED:
        _LOADED[path] = load_model(path)
    return _LOADED[path]


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    c = loaded.config
    return c.kv_bytes_per_token(4)  # fp32


def settings_from(
    args: argparse.Namespace, loaded: LoadedModel, block_size: int | None = None
) -> BenchSettings:
    bs = block_size or args.block_size
    if not 1 <= bs <= 256:
        raise ValueError(f"block size must be in [1, 256], got {bs}")
    if args.kv_cache_memory is not None:
        tokens = parse_size(args.kv_cache_memory) // kv_bytes_per_token(loaded)
    else:
        tokens = args.kv_cache_tokens or DEFAULT_KV_TOKENS
    context = loaded.config.max_position_embeddings
    max_len = args.max_model_len or min(DEFAULT_MAX_MODEL_LEN, context)
    if max_len > context:
        raise ValueError(f"--max-model-len {max_len} exceeds the model's context ({context})")
    blocks = tokens // bs
    if blocks * bs < max_len + bs:
        raise ValueError(
            f"the KV budget ({tokens} tokens) must hold at least one max_model_len "
            f"({max_len}) request plus a block; raise --kv-cache-tokens or lower --max-model-len"
        )
    return BenchSettings(bs, blocks, max_len, args.max_num_seqs, args.max_num_batched_tokens)


def workload_from(
    args: argparse.Namespace, loaded: LoadedModel, max_model_len: int
) -> list[BenchRequest]:
    spec = WorkloadSpec(
        kind=args.workload,
        num_prompts=args.num_prompts,
        seed=args.seed,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        prompt_range=tuple(args.prompt_range),
        output_range=tuple(args.output_range),
        scale=args.sharegpt_scale,
    )
    return make_workload(spec, loaded.config.vocab_size, max_model_len)


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run."""
    argv = getattr(args, "argv", None)  # set by `bench report` for its suite
    if argv is None and os.path.basename(sys.argv[0]) in ("pagedllm", "cli.py", "__main__.py"):
        argv = sys.argv[1:]
    if argv is None:  # called in-process (tests): name the subcommand only
        argv = ["bench", getattr(args, "bench_command", None) or "?"]
    return "pagedllm " + shlex.join(argv)


def environment() -> dict[str, Any]:
    """The machine and its load: benchmarks here share 2 cores with other work."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (active spinning)"),
        "load_average_1m_at_start": round(load[0], 2),
    }


def base_result(
    name: str,
    args: argparse.Namespace,
    loaded: LoadedModel,
    settings: BenchSettings | None,
    requests: list[BenchRequest] | None,
) -> dict:
    """The skeleton every bench fills: command, config, environment and workload."""
    from pagedllm.bench.workload import summarize

    config: dict[str, Any] = {"model": os.path.basename(loaded.source.rstrip("/"))}
    if settings is not None:
        config.update(
            block_size=settings.block_size,
            kv_tokens=settings.kv_tokens,
            kv_blocks=settings.num_kv_blocks,
            kv_mib=round(settings.kv_tokens * kv_bytes_per_token(loaded) / 2**20, 1),
            max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
        )
    workload = None
    if requests is not None:
        workload = {"kind": args.workload, "seed": args.seed, **summarize(requests)}
        if args.workload == "sharegpt":
            workload["sharegpt_scale"] = args.sharegpt_scale
    return {
        "bench": name,
        "command": command_line(args),
        "config": config,
        "environment": environment(),
        "workload": workload,
        "results": [],
        "ratios": {},
        "notes": [],
    }
