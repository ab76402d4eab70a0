"""RunnerOptions: how a model runner computes, in one frozen, validated dataclass.

The runner's own options, so that worker/ never reads the engine's configuration: the
engine (or a bench that builds a runner itself) hands over these fields, e.g. with
`RunnerOptions.of(engine_config)`. A bad value raises InvalidParameterError naming the
option. Plain Python: importing it needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from pagedllm.errors import InvalidParameterError
from pagedllm.validation import check_int

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", *DTYPES)  # auto: the model's dtype
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton")
# How the linear layers compute (the model's and, as speculative_quantization, the
# draft's): "none": the weights dequantized to `dtype`, exact to the reference; "int8": W8A8
# linear layers; "gguf": a GGUF file's linear weights kept in their blocks, computed on as
# stored; "auto": gguf for a GGUF whose linear weights are block-quantized where that path
# runs, else none (worker/quantization_choice.py resolves it before the model loads).
QUANTIZATIONS = ("auto", "none", "int8", "gguf")
# The values that change the weights' form, and so need the CPU and a float32 model.
QUANTIZED = ("int8", "gguf")
MAX_LORA_RANK = 512


@dataclass(frozen=True)
class RunnerOptions:
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0  # of the sampler's generator (seeded samples have their own)
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    quantization: str = "auto"  # QUANTIZATIONS; int8 and gguf: CPU, float32 model
    tensor_parallel_size: int = 1  # ranks the model is split over (worker/tp_runner.py)
    # Speculative decoding with a draft model (worker/draft_model.py): the draft's path
    # (or packaged name), None: no draft; and how its linear layers compute.
    speculative_model: str | None = None
    speculative_quantization: str = "auto"
    # LoRA adapters (worker/lora_step.py): requests may run under PEFT adapters of at most
    # max_lora_rank, kept in pool pages; max_cpu_loras loaded adapters stay in host memory.
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_cpu_loras: int = 32

    def __post_init__(self) -> None:
        for name, allowed in (
            ("dtype", DTYPES),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("attention_backend", ATTENTION_BACKENDS),
            ("quantization", QUANTIZATIONS),
            ("speculative_quantization", QUANTIZATIONS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                names = ", ".join(str(a) for a in allowed)
                raise InvalidParameterError(name, f"{name} must be one of {names}, got {value!r}")
        size = check_int(self.tensor_parallel_size, "tensor_parallel_size", min=1)
        if self.quantization in QUANTIZED and (
            not self.device.startswith("cpu") or self.dtype != "float32"
        ):
            raise InvalidParameterError(
                "quantization",
                f"quantization={self.quantization!r} runs on the CPU with dtype float32; got "
                f"device={self.device!r}, dtype={self.dtype!r}",
            )
        if self.quantization == "gguf" and size > 1:
            raise InvalidParameterError(
                "quantization",
                "quantization='gguf' runs on one device: use tensor_parallel_size 1 "
                f"(got {size}), or quantization none or auto",
            )
        self._check_draft()
        self._check_lora()
        if size > 1 and self.device not in ("cpu", "cuda"):
            raise InvalidParameterError(
                "device",
                "with tensor_parallel_size > 1, device must be 'cpu' or 'cuda' (rank r takes "
                f"its machine's GPU r, LOCAL_RANK under torchrun), got {self.device!r}",
            )

    def _check_draft(self) -> None:
        if self.speculative_quantization != "auto" and self.speculative_model is None:
            raise InvalidParameterError(
                "speculative_quantization",
                "speculative_quantization quantizes the draft model: it needs "
                "speculative_method 'draft' and a speculative_model",
            )
        if self.speculative_quantization in QUANTIZED and (
            not self.device.startswith("cpu") or self.dtype != "float32"
        ):
            raise InvalidParameterError(
                "speculative_quantization",
                f"speculative_quantization={self.speculative_quantization!r} runs on the CPU "
                f"with dtype float32; got device={self.device!r}, dtype={self.dtype!r}",
            )
        if self.speculative_model is not None and self.tensor_parallel_size > 1:
            raise InvalidParameterError(
                "speculative_model",
                "a draft model runs on one device: use tensor_parallel_size 1 with "
                f"speculative_method 'draft' (got {self.tensor_parallel_size}), or 'ngram'",
            )

    def _check_lora(self) -> None:
        check_int(self.max_lora_rank, "max_lora_rank", min=1, max=MAX_LORA_RANK)
        check_int(self.max_cpu_loras, "max_cpu_loras", min=1)
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise InvalidParameterError(
                "enable_lora",
                "LoRA adapters run on one device: use tensor_parallel_size 1 "
                f"(got {self.tensor_parallel_size})",
            )

    def draft_options(self) -> RunnerOptions:
        """The options of the draft model's own runner: the target's numerics, the
        draft's quantization, no draft of its own."""
        return replace(
            self,
            quantization=self.speculative_quantization,
            speculative_model=None,
            speculative_quantization="auto",
            enable_lora=False,  # the draft proposes from the base model
        )

    @classmethod
    def of(cls, config: object) -> RunnerOptions:
        """The runner's options out of a larger configuration that has these fields by
        name (the engine's)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def for_rank(self, device: str) -> RunnerOptions:
        """The options of one tensor-parallel rank's own runner, on `device`."""
        return replace(self, device=device, tensor_parallel_size=1)
