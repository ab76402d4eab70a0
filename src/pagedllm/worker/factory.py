"""Which model runner an engine gets from its configuration: the single-device
TorchModelRunner, or the TensorParallelRunner for `tensor_parallel_size > 1`.

Under a launcher (torchrun), the processes of ranks other than 0 never build an engine:
they serve the driver from here and exit (worker/tp_worker.py).
"""

from __future__ import annotations

from typing import Any

from pagedllm.engine.config import EngineConfig
from pagedllm.loader import LoadedModel, load_model
from pagedllm.worker.model_runner import TorchModelRunner
from pagedllm.worker.runner import ModelRunner


def build_runner(
    config: EngineConfig, loaded: LoadedModel | None = None
) -> tuple[ModelRunner, Any]:
    """The runner for `config` over `loaded` (else loaded from `config.model`), and the
    model's tokenizer."""
    # What every rank's TorchModelRunner computes with; the device is each rank's own.
    options: dict[str, Any] = dict(
        dtype=config.dtype,
        seed=config.seed,
        kv_cache_dtype=config.kv_cache_dtype,
        attention_backend=config.attention_backend,
        quantization=config.quantization,
    )
    if config.tensor_parallel_size > 1:
        from pagedllm.worker.tp_runner import TensorParallelRunner, backend_for
        from pagedllm.worker.tp_worker import serve_if_worker_rank

        serve_if_worker_rank(backend_for(config.device, config.tensor_parallel_size))
        loaded = loaded if loaded is not None else load_model(config.model)
        return TensorParallelRunner(config, loaded, options), loaded.tokenizer
    loaded = loaded if loaded is not None else load_model(config.model)
    return TorchModelRunner(loaded, device=config.device, **options), loaded.tokenizer
