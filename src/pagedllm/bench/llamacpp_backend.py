"""The llama.cpp baseline (`llama-cpp-python`), run only where it is installed.

Its bundled server serves one request at a time, so requests run one after another;
each generates exactly its `output_len` tokens (EOS is not checked). No wheel of
`llama-cpp-python` exists for this machine (only an sdist that needs a long compile),
so on it this backend reports itself skipped.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Sequence
from typing import Any

from pagedllm.bench.workload import BenchRequest
from pagedllm.loader import LoadedModel

SKIP_MESSAGE = "llama-cpp-python is not installed (no wheel for this machine): skipped"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def run_llama_cpp(
    loaded: LoadedModel, requests: Sequence[BenchRequest], max_model_len: int
) -> dict[str, Any]:
    if not available():
        return {"system": "llama-cpp", "skipped": SKIP_MESSAGE}
    if not loaded.gguf_file:
        return {"system": "llama-cpp", "skipped": "the model is not a GGUF file: skipped"}
    from llama_cpp import Llama  # type: ignore[import-not-found]

    llm = Llama(
        model_path=os.path.join(loaded.hf_dir, loaded.gguf_file),
        n_ctx=max_model_len,
        n_threads=os.cpu_count() or 1,
        verbose=False,
    )
    start = time.perf_counter()
    generated = 0
    for r in requests:
        llm.reset()
        for n, _token in enumerate(llm.generate(list(r.prompt_token_ids), temp=0.0), 1):
            if n >= r.output_len:
                break
        generated += r.output_len
    elapsed = time.perf_counter() - start
    return {
        "system": "llama-cpp",
        "requests": len(requests),
        "generated_tokens": generated,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "generated_tokens_per_s": round(generated / elapsed, 2),
        "mean_running_seqs": 1.0,
        "peak_running_seqs": 1,
        "preemptions": 0,
    }
