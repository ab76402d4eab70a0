"""Which model runner an engine gets from its runner options: the single-device
TorchModelRunner, or the TensorParallelRunner for `tensor_parallel_size > 1`. A
TorchModelRunner gets the draft model's own runner when the options name a
speculative_model. "auto" quantizations are decided first (worker/quantization_choice.py);
with quantization="gguf" the model is loaded with its GGUF blocks kept (a model given
already loaded the other way is loaded again), and so is a draft with
speculative_quantization="gguf".

Under a launcher (torchrun), the processes of ranks other than 0 never build an engine:
they serve the driver from here and exit (worker/tp_worker.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from pagedllm.errors import InvalidParameterError, ModelLoadError
from pagedllm.loader import LoadedModel, load_model, resolve_model_path
from pagedllm.worker.model_runner import TorchModelRunner
from pagedllm.worker.options import RunnerOptions
from pagedllm.worker.quantization_choice import resolve_quantization
from pagedllm.worker.runner import ModelRunner


class RealRunner(ModelRunner, Protocol):
    """What the runners over a real model offer beyond the engine's interface: the
    benches' measurements."""

    attention: Any  # the attention backend (its `name`)

    @property
    def attention_seconds(self) -> float | None:
        """Seconds in attention so far, when built with `profile_attention`."""
        ...

    @property
    def comm_seconds(self) -> float:
        """Seconds in tensor-parallel collectives so far (0 on one device)."""
        ...

    def logits_of(self, token_ids: Sequence[int], chunk: int = 512) -> torch.Tensor:
        """Teacher-forced logits [len, vocab] through a private cache."""
        ...

    @property
    def int8_kernels(self) -> dict[str, str]:
        """The int8 kernels of each kind of linear layer and "isa" (empty: none here)."""
        ...


def build_runner(
    options: RunnerOptions,
    model: str | None = None,
    loaded: LoadedModel | None = None,
    *,
    profile_attention: bool = False,
) -> tuple[RealRunner, Any]:
    """The runner for `options` over `loaded` (else loaded from the path `model`; None:
    the default model), and the model's tokenizer. `profile_attention`: the runner adds up
    the seconds its attention takes (on the driver, under tensor parallelism)."""
    options = resolve_quantization(options, model, loaded)
    if options.tensor_parallel_size > 1:
        from pagedllm.worker.tp_runner import TensorParallelRunner, backend_for
        from pagedllm.worker.tp_worker import serve_if_worker_rank

        serve_if_worker_rank(backend_for(options.device, options.tensor_parallel_size))
        loaded = _loaded_for(options, model, loaded)
        runner = TensorParallelRunner(options, loaded, profile_attention=profile_attention)
        return runner, loaded.tokenizer
    loaded = _loaded_for(options, model, loaded)
    draft = None
    if options.speculative_model is not None:
        draft_options = options.draft_options()
        draft = TorchModelRunner(
            _draft_model(options.speculative_model, loaded, draft_options), draft_options
        )
    runner = TorchModelRunner(loaded, options, profile_attention=profile_attention, draft=draft)
    return runner, loaded.tokenizer


def _loaded_for(
    options: RunnerOptions, path: str | None, loaded: LoadedModel | None
) -> LoadedModel:
    """`loaded`, or the model at `path`, loaded as `options.quantization` computes on it."""
    keep = options.quantization == "gguf"
    if loaded is not None and loaded.kept_quantized == keep:
        return loaded
    return load_model(path if loaded is None else loaded.source, keep_quantized=keep)


def _draft_model(path: str, target: LoadedModel, options: RunnerOptions) -> LoadedModel:
    """The draft model at `path`, loaded as `options.quantization` computes on it: the
    target's own weights when it names the same file loaded in that form (a self-draft,
    e.g. quantized; each model copies the weights it computes with, and blocks kept are
    views of the file's map, or one interleaved copy the two models share)."""
    keep = options.quantization == "gguf"
    try:
        same = os.path.realpath(resolve_model_path(path)) == os.path.realpath(target.source)
        if same and target.kept_quantized == keep:
            return target
        return load_model(path, keep_quantized=keep)
    except InvalidParameterError as exc:  # the draft's blocks cannot be kept
        message = f"speculative_model: {exc}"
        raise InvalidParameterError("speculative_quantization", message) from exc
    except ModelLoadError as exc:  # say which of the two models it was
        raise ModelLoadError(f"speculative_model: {exc}") from exc
