"""The engine's command-line options: one builder shared by `generate`, `serve` and the
benches.

Every EngineConfig field has exactly one option here, and its default comes from
EngineConfig itself, so the command line and the Python API cannot drift apart. A command
may start from other defaults (`add_engine_args(parser, enable_prefix_caching=False)`),
so a boolean takes both forms (`--prefix-caching`, `--no-prefix-caching`); values are
validated by EngineConfig, whose errors name the option.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.core.reservation import RESERVATION_POLICIES
from pagedllm.engine.config import LORA_SLOTS, EngineConfig
from pagedllm.engine.kv_event_access import CLIENT_PUBLIC_KEYS_ENV, SERVER_SECRET_KEY_ENV
from pagedllm.kv.block_table import MAX_BLOCK_SIZE
from pagedllm.worker.options import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    MAX_LORA_RANK,
    QUANTIZATIONS,
)


@dataclass(frozen=True)
class _Option:
    field: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    flag: str | None = None  # default: --field-name
    boolean: bool = False  # --flag and --no-flag, whatever the default

    @property
    def dest(self) -> str:
        # The engine's seed stays apart from a command's own --seed (a request's seed).
        return "engine_seed" if self.field == "seed" else self.field


OPTIONS = (
    _Option(
        "model",
        "a .gguf file, a Hugging Face directory, or a packaged model: smollm2-135m "
        "(the default, SmolLM2-135M-Instruct) or gemma3-270m",
    ),
    _Option("block_size", f"tokens per KV block (1..{MAX_BLOCK_SIZE})", int),
    _Option("kv_cache_memory", "KV pool size, e.g. 256MiB or 2GB"),
    _Option("num_kv_blocks", "KV pool size in blocks (overrides --kv-cache-memory)", int),
    _Option("max_num_seqs", "most sequences running at once", int),
    _Option("max_num_batched_tokens", "most tokens computed in one step", int),
    _Option("max_model_len", "context limit (default: the model's, capped by the pool)", int),
    _Option("dtype", "dtype of weights and activations", choices=DTYPES),
    _Option(
        "kv_cache_dtype",
        "dtype of the KV cache (auto: the model's; float16 holds twice the tokens)",
        choices=KV_CACHE_DTYPES,
    ),
    _Option(
        "attention_backend",
        "paged attention kernel (auto: compiled on CPU, Triton on CUDA)",
        choices=ATTENTION_BACKENDS,
    ),
    _Option(
        "quantization",
        "how the linear layers compute: gguf keeps a GGUF file's linear weights in their "
        "quantized blocks (CPU, float32, one device); none dequantizes the weights to --dtype "
        "(exact); int8: int8 weights and activations; auto: gguf for a GGUF whose linear "
        "weights are quantized, where gguf runs, else none",
        choices=QUANTIZATIONS,
    ),
    _Option("device", "torch device: cpu, cuda, cuda:1, ..."),
    _Option(
        "tensor_parallel_size",
        "split the model over N ranks (spawned here, or the ranks torchrun started)",
        int,
    ),
    _Option(
        "enable_prefix_caching",
        "reuse the KV blocks of shared prompt prefixes",
        flag="--prefix-caching",
        boolean=True,
    ),
    _Option(
        "disable_hybrid_kv_cache_manager",
        "allocate sliding-window layers' KV for the whole sequence, as full attention "
        "(they still attend over their window); for comparison",
        boolean=True,
    ),
    _Option(
        "kv_reservation",
        "paged allocates blocks on demand; the others reserve up front (baselines)",
        choices=RESERVATION_POLICIES,
    ),
    _Option("watermark", "fraction of blocks kept free when admitting requests", float),
    _Option("seed", "seed of the sampling of unseeded requests", int, flag="--engine-seed"),
    _Option(
        "grammar_cache_mb",
        "MiB the compiled grammars kept for reuse may take (structured output; 0: none kept)",
        float,
    ),
    _Option(
        "kv_events_endpoint",
        "publish prefix-cache events (vLLM's KV events, msgpack over ZeroMQ PUB; they carry "
        "every prompt's token ids) on this endpoint, which routers subscribe to: "
        "tcp://127.0.0.1:PORT, ipc://PATH (this machine only); tcp://*:PORT or another "
        "address needs --kv-events-allow-remote",
    ),
    _Option(
        "kv_events_allow_remote",
        "let --kv-events-endpoint be an address other machines can reach (a wildcard or a "
        "non-loopback address); subscribers must then hold a CURVE key of "
        "--kv-events-client-keys, unless --kv-events-allow-unauthenticated",
        boolean=True,
    ),
    _Option(
        "kv_events_server_key",
        "the KV-event publisher's CURVE secret key: a .key_secret certificate as "
        f"zmq.auth.create_certificates writes (default: ${SERVER_SECRET_KEY_ENV})",
    ),
    _Option(
        "kv_events_client_keys",
        "the CURVE public keys of the subscribers allowed: a directory of .key certificates, "
        f"or one (default: ${CLIENT_PUBLIC_KEYS_ENV}, Z85 keys separated by commas)",
    ),
    _Option(
        "kv_events_allow_unauthenticated",
        "with --kv-events-allow-remote and no keys: publish anyway, to anyone who can connect",
        boolean=True,
    ),
    _Option(
        "speculative_method",
        "speculative decoding: ngram proposes tokens by prompt lookup, draft by a smaller "
        "model with the same vocabulary (--speculative-model); the model checks them in one "
        "step",
        choices=("ngram", "draft"),
    ),
    _Option("num_speculative_tokens", "tokens proposed per sequence and step (1..128)", int),
    _Option(
        "speculative_model",
        "the draft model (speculative method draft): a .gguf file, a Hugging Face directory "
        "or a packaged model, as --model",
    ),
    _Option(
        "speculative_quantization",
        "how the draft model's linear layers compute, as --quantization (for the draft's "
        "file); e.g. int8 makes the target itself a cheaper draft",
        choices=QUANTIZATIONS,
    ),
    _Option("prompt_lookup_min", "ngram: shortest suffix looked up (default 5)", int),
    _Option("prompt_lookup_max", "ngram: longest suffix looked up (default 5)", int),
    _Option(
        "speculative_disable_by_batch_size",
        "speculate only while fewer sequences than this are running (default 4, measured; "
        "a value above --max-num-seqs speculates at every batch size)",
        int,
    ),
    _Option(
        "enable_lora",
        "let requests run under LoRA adapters of this base (PEFT format)",
        boolean=True,
    ),
    _Option("max_lora_rank", f"the highest adapter rank accepted (1..{MAX_LORA_RANK})", int),
    _Option(
        "lora_slots",
        "where adapters live: unified takes pages of the KV pool as adapters are used and "
        "evicts unused ones when KV needs the room; static reserves --max-loras slots of the "
        "--max-lora-rank size at start (a fixed split, for comparison)",
        choices=LORA_SLOTS,
    ),
    _Option("max_loras", "adapter slots with --lora-slots static", int),
    _Option("max_cpu_loras", "adapters kept in host memory for reloading into the pool", int),
)


def add_engine_args(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Add every engine option to `parser`; `defaults` overrides EngineConfig's."""
    base = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    unknown = set(defaults) - set(base)
    if unknown:
        raise ValueError(f"not engine options: {sorted(unknown)}")
    group = parser.add_argument_group("engine")
    for opt in OPTIONS:
        default = defaults.get(opt.field, base[opt.field])
        flag = opt.flag or "--" + opt.field.replace("_", "-")
        shown = "" if default is None else f" (default: {default})"
        kwargs: dict[str, Any] = dict(dest=opt.dest, default=default, help=opt.help + shown)
        if opt.boolean:  # no type or choices: BooleanOptionalAction warns of them (3.14)
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            group.add_argument(flag, type=opt.type, choices=opt.choices, **kwargs)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of parsed arguments, as EngineConfig keywords."""
    return {opt.field: getattr(args, opt.dest) for opt in OPTIONS}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**engine_options(args))
