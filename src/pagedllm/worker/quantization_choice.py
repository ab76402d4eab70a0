"""Which path `quantization="auto"` (the default) takes, decided once, before the model loads.

"auto" keeps a GGUF's linear weights in their blocks (quantization "gguf": what llama.cpp
does, and vLLM's --quantization gguf) when the file has at least one block-quantized
linear weight and every linear weight is of a type the kernels take, on the CPU, in
float32, on one device, where the CPU runs the compiled kernels (without them the GGUF
layers would dequantize every weight at every call). Otherwise it is "none": the weights
dequantized to `dtype`, exact to transformers. A model handed over already loaded keeps
the form it was loaded in. The draft model's `speculative_quantization="auto"` follows the
same rule on the draft's file. One INFO line says which path was taken and why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING

from pagedllm.errors import ModelLoadError
from pagedllm.kernels.cpu import missing_cpu_features
from pagedllm.worker.options import RunnerOptions

if TYPE_CHECKING:
    from pagedllm.loader import LoadedModel

logger = logging.getLogger("pagedllm")


def resolve_quantization(
    options: RunnerOptions, model: str | None, loaded: LoadedModel | None = None
) -> RunnerOptions:
    """`options` with `quantization` and `speculative_quantization` decided ("auto" no
    more) for the model at `model` (None: the default model) or the one given `loaded`."""
    quantization = options.quantization
    if quantization == "auto":
        quantization = _decide("quantization", options, model, loaded)
    draft = options.speculative_quantization
    if draft == "auto" and options.speculative_model is not None:
        draft = _decide("speculative_quantization", options, options.speculative_model, None)
    return replace(options, quantization=quantization, speculative_quantization=draft)


def _decide(
    option: str, options: RunnerOptions, model: str | None, loaded: LoadedModel | None
) -> str:
    path, why = auto_quantization(options, model, loaded)
    if why and path == "gguf":
        logger.info("%s auto: gguf, %s", option, why)
    elif why:  # (none without a why: the loader's error about the model follows, alone)
        logger.info("%s auto: none (%s): weights dequantized to %s", option, why, options.dtype)
    return path


def auto_quantization(
    options: RunnerOptions, model: str | None, loaded: LoadedModel | None = None
) -> tuple[str, str]:
    """What "auto" means for this model under `options`: ("gguf" or "none", why); why
    is "" for a model whose header cannot be read (the loader then says why)."""
    if loaded is not None:
        if loaded.kept_quantized:
            return "gguf", "as the model given was loaded (its GGUF blocks kept)"
        return "none", "as the model given was loaded"
    if options.tensor_parallel_size > 1:
        return "none", "tensor parallelism"
    if not options.device.startswith("cpu"):
        return "none", f"device {options.device}"
    if options.dtype != "float32":
        return "none", f"dtype {options.dtype}"
    missing = missing_cpu_features()
    if missing:
        return "none", f"this CPU has no {', '.join(missing)} for the gguf kernels"
    from pagedllm.loader import resolve_model_path
    from pagedllm.loader.memory_estimate import read_model_header

    try:
        path = resolve_model_path(model)
        header = read_model_header(path) if os.path.exists(path) else None
    except (ModelLoadError, ValueError, KeyError, TypeError):
        header = None  # the loader says what is wrong with the model, in its own words
    if header is None:
        return "none", ""
    if not header.is_gguf:
        return "none", "a Hugging Face directory"
    linear = [t for t in header.tensors if t.is_linear]
    odd = next((t for t in linear if not t.kernel_type), None)
    if odd is not None:
        return "none", f"{odd.name} is {odd.type_name}, which the gguf kernels do not take"
    kinds = sorted({t.type_name for t in linear if t.block_quantized})
    if not kinds:
        return "none", "no linear weight of the file is block-quantized"
    return "gguf", f"the file's {', '.join(kinds)} blocks computed on as stored"
