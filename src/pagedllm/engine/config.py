"""EngineConfig: every engine option in one frozen, validated dataclass.

Sizes of the KV pool may be given in blocks (`num_kv_blocks`) or in bytes
(`kv_cache_memory`, an int or a string such as "256MiB"). A bad value raises
InvalidParameterError naming the option.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

from pagedllm.core.reservation import check_policy
from pagedllm.engine.kv_event_access import CurveKeys, publisher_keys
from pagedllm.errors import InvalidParameterError
from pagedllm.kv.block_table import check_block_size
from pagedllm.spec.config import SpeculativeConfig, speculative_config_from
from pagedllm.validation import as_int, check_int
from pagedllm.worker.options import RunnerOptions

LORA_SLOTS = ("unified", "static")

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(value: int | str, param: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string like "256MiB", "1.5GB", "1048576"."""
    if (number := as_int(value)) is not None:
        return number
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise InvalidParameterError(
            param, f"{param} must be a byte count like '256MiB' or '2GB', got {value!r}"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the default SmolLM2-135M-Instruct GGUF
    block_size: int = 16
    kv_cache_memory: int | str = "1GiB"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context, capped by the pool
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"  # half precision holds twice the tokens in the same memory
    attention_backend: str = "auto"
    # How the linear layers compute (worker/options.py): "auto" (gguf for a GGUF whose linear
    # weights are block-quantized, where that path runs; else none), "none" (weights
    # dequantized to dtype, exact), "int8" (W8A8), "gguf" (a GGUF's blocks as stored).
    # LLMEngine resolves "auto" before loading: its config says the path taken.
    quantization: str = "auto"
    device: str = "cpu"
    tensor_parallel_size: int = 1  # ranks the model is split over (worker/tp_runner.py)
    enable_prefix_caching: bool = True
    # Allocate every layer as full attention (sliding-window layers still compute over
    # their window): the layer-group manager's comparison point.
    disable_hybrid_kv_cache_manager: bool = False
    kv_reservation: str = "paged"
    watermark: float = 0.01  # fraction of blocks kept free when admitting new requests
    seed: int = 0
    # The most the compiled grammars kept for reuse (structured output) may take, in MiB.
    # 64 ordinary JSON schemas take 3-10 MiB on SmolLM2's vocabulary; a choice among 10,000
    # strings takes 30 MiB, one among 50,000 about 150 (used, but never kept). 0: none kept.
    grammar_cache_mb: float = 64.0
    # Publish the prefix cache's changes (vLLM's KV events: msgpack over ZeroMQ) on this
    # endpoint, which the engine binds: "tcp://127.0.0.1:5557", port * for any free one,
    # "ipc://PATH"; None: no events. They carry every prompt's token ids, so an endpoint
    # other machines can reach ("tcp://*:5557") needs kv_events_allow_remote, and then
    # CURVE keys (engine/kv_event_access.py, docs/kv-events.md).
    kv_events_endpoint: str | None = None
    kv_events_allow_remote: bool = False
    kv_events_server_key: str | None = None  # the publisher's .key_secret certificate
    kv_events_client_keys: str | None = None  # subscribers' .key certificates: a folder or one
    kv_events_allow_unauthenticated: bool = False  # remote without keys: anyone may subscribe
    # Speculative decoding (spec/config.py, docs/speculative.md): "ngram" proposes the
    # next num_speculative_tokens tokens by prompt lookup, "draft" has a smaller model
    # with the same vocabulary (speculative_model, a path or packaged name as `model`)
    # propose them, and the model checks them in one step; None: one token per step.
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    speculative_model: str | None = None
    speculative_quantization: str = "auto"  # the draft's, as quantization (its own file)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    speculative_disable_by_batch_size: int | None = None
    # LoRA adapters (docs/lora.md): requests may run under a PEFT adapter of this base. With
    # lora_slots "unified" an adapter takes pages of the KV pool while it is used and is
    # evicted, least recently used first, when KV needs the room (S-LoRA's unified paging);
    # "static" reserves max_loras slots of the max_lora_rank size at start (vLLM's), which
    # KV never gets. max_cpu_loras: adapters kept in host memory for reloading.
    enable_lora: bool = False
    max_lora_rank: int = 16
    lora_slots: str = "unified"
    max_loras: int = 1
    max_cpu_loras: int = 32

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        if parse_size(self.kv_cache_memory) <= 0:
            raise InvalidParameterError(
                "kv_cache_memory", f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            check_int(getattr(self, name), name, min=1)
        for name in ("num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, min=1)
        spec = self.speculative_config  # before the runner's options: its messages first
        self.runner_options  # noqa: B018 - built now, so that its own checks run at creation
        check_policy(self.kv_reservation)
        if not (
            isinstance(self.grammar_cache_mb, (int, float)) and 0 <= self.grammar_cache_mb < 2**40
        ):
            raise InvalidParameterError(
                "grammar_cache_mb",
                f"grammar_cache_mb must be a number in [0, 2**40), got {self.grammar_cache_mb!r}",
            )
        if not 0 <= self.watermark < 1:
            raise InvalidParameterError(
                "watermark", f"watermark must be in [0, 1), got {self.watermark}"
            )
        if spec is not None and self.kv_reservation != "paged":
            raise InvalidParameterError(
                "speculative_method",
                "speculative decoding needs kv_reservation='paged': the contiguous "
                f"baselines reserve their slots up front, got {self.kv_reservation!r}",
            )
        self._check_lora()
        self.kv_events_keys()  # the endpoint and the keys checked now, before a model loads

    def _check_lora(self) -> None:
        """The engine's LoRA options (the runner's own, max_lora_rank and max_cpu_loras,
        and its one-device rule, are checked by RunnerOptions)."""
        check_int(self.max_loras, "max_loras", min=1)
        if self.lora_slots not in LORA_SLOTS:
            raise InvalidParameterError(
                "lora_slots",
                f"lora_slots must be one of {', '.join(LORA_SLOTS)}, got {self.lora_slots!r}",
            )
        if not self.enable_lora:
            return
        if self.kv_reservation != "paged":
            raise InvalidParameterError(
                "enable_lora",
                "LoRA adapters take pages of the paged pool: enable_lora needs "
                f"kv_reservation='paged', got {self.kv_reservation!r}",
            )

    def with_quantizations_of(self, options: RunnerOptions) -> EngineConfig:
        """This configuration with the quantizations `options` hold (once "auto" is decided:
        worker/quantization_choice.py)."""
        return replace(
            self,
            quantization=options.quantization,
            speculative_quantization=options.speculative_quantization,
        )

    @cached_property
    def runner_options(self) -> RunnerOptions:
        """What the model runner computes with: this configuration's share of options
        (built, and so checked, once: in __post_init__)."""
        return RunnerOptions.of(self)

    def kv_events_keys(self) -> CurveKeys | None:
        """The CURVE keys the KV-event publisher authenticates subscribers with (None: none),
        once its endpoint is checked. Read from their files or the environment at each call:
        secrets are not kept in the configuration, which is sent to replicas."""
        if self.kv_events_endpoint is None:
            return None
        return publisher_keys(
            self.kv_events_endpoint,
            allow_remote=self.kv_events_allow_remote,
            server_key=self.kv_events_server_key,
            client_keys=self.kv_events_client_keys,
            allow_unauthenticated=self.kv_events_allow_unauthenticated,
        )

    @cached_property
    def speculative_config(self) -> SpeculativeConfig | None:
        """The speculative decoding these options ask for, None when none (built, and so
        checked, in __post_init__)."""
        return speculative_config_from(
            self.speculative_method,
            self.num_speculative_tokens,
            self.speculative_model,
            self.prompt_lookup_min,
            self.prompt_lookup_max,
            self.speculative_disable_by_batch_size,
            self.speculative_quantization,
        )

    def kv_blocks(self, block_bytes: int) -> int:
        """The KV pool's blocks for blocks of `block_bytes`: num_kv_blocks, else as many as
        kv_cache_memory holds (at least one)."""
        return self.num_kv_blocks or max(1, parse_size(self.kv_cache_memory) // block_bytes)

    def pool_size(
        self,
        block_bytes: int,
        max_positions: int,
        blocks_for: Callable[[int], int] | None = None,
    ) -> tuple[int, int, int]:
        """(KV blocks, watermark blocks, max_model_len) for blocks of `block_bytes` and a
        model of `max_positions`: a request may grow to every block but the watermark.
        `blocks_for(n)`: the blocks one sequence of n tokens holds at most (default: one
        per `block_size` tokens; fewer with sliding-window layer groups)."""
        num_blocks = self.kv_blocks(block_bytes)
        watermark_blocks = min(int(self.watermark * num_blocks), num_blocks - 1)
        usable = num_blocks - watermark_blocks
        if blocks_for is None:
            max_len = min(max_positions, usable * self.block_size)
        else:  # the longest sequence that fits: blocks_for grows with n
            low, high = 0, max_positions
            while low < high:
                mid = (low + high + 1) // 2
                low, high = (mid, high) if blocks_for(mid) <= usable else (low, mid - 1)
            max_len = low
        if self.max_model_len is not None:
            if self.max_model_len > max_positions:
                raise InvalidParameterError(
                    "max_model_len",
                    f"max_model_len ({self.max_model_len}) exceeds the model's context "
                    f"({max_positions})",
                )
            max_len = self.max_model_len
        return num_blocks, watermark_blocks, max_len
