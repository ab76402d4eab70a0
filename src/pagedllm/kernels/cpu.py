"""Building and loading the compiled CPU kernels (the C++ sources in csrc/).

The sources ship inside the package and are compiled at first use with torch's extension
tools (`-O3 -mavx2 -mfma -mf16c -fopenmp`, and the rules of policy.py that a template
needs at compile time as `-D`) into one library, once per source (headers included),
torch version and flags: it is cached under `$PAGEDLLM_CACHE_DIR` (default ~/.cache/pagedllm),
and later processes just load it. `load_cpu_ops()` returns the `torch.ops.pagedllm_cpu`
namespace or raises KernelUnavailableError saying why (no AVX2/FMA/F16C, no compiler, a
failed build), so that callers can fall back to their pure-torch paths.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from pagedllm.cache_root import cache_root
from pagedllm.errors import KernelUnavailableError
from pagedllm.kernels.policy import (
    GEMV_MAX_ROWS,
    GGUF_GEMM_MIN_ROWS,
    GGUF_INTERLEAVED_IN_PLACE_MAX_ROWS,
    GGUF_Q4_0_Q4_1_GEMM_MIN_ROWS,
    GGUF_Q4_K_INTERLEAVED_MIN_ROWS,
    GGUF_Q6_K_INTERLEAVED_MIN_ROWS,
    PANEL_GEMV_MAX_ROWS,
)

logger = logging.getLogger("pagedllm")
CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cpp"))
FLAGS = [
    "-O3",
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-fopenmp",
    "-std=c++17",
    f"-DPAGEDLLM_GEMV_MAX_ROWS={GEMV_MAX_ROWS}",
    f"-DPAGEDLLM_PANEL_GEMV_MAX_ROWS={PANEL_GEMV_MAX_ROWS}",
    f"-DPAGEDLLM_GGUF_GEMM_MIN_ROWS={GGUF_GEMM_MIN_ROWS}",
    f"-DPAGEDLLM_GGUF_Q4_0_Q4_1_GEMM_MIN_ROWS={GGUF_Q4_0_Q4_1_GEMM_MIN_ROWS}",
    f"-DPAGEDLLM_GGUF_Q4_K_INTERLEAVED_MIN_ROWS={GGUF_Q4_K_INTERLEAVED_MIN_ROWS}",
    f"-DPAGEDLLM_GGUF_Q6_K_INTERLEAVED_MIN_ROWS={GGUF_Q6_K_INTERLEAVED_MIN_ROWS}",
    f"-DPAGEDLLM_GGUF_INTERLEAVED_IN_PLACE_MAX_ROWS={GGUF_INTERLEAVED_IN_PLACE_MAX_ROWS}",
]
NAME = "pagedllm_cpu_ops"
_lock = threading.Lock()
_ops: Any = None
_error: KernelUnavailableError | None = None


def cache_dir() -> Path:
    return cache_root() / "kernels"


def missing_cpu_features() -> list[str]:
    """The instruction sets the kernels need that this CPU lacks (empty: they can run)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [f"an x86-64 CPU (this is {platform.machine()})"]
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith("flags")]
        flags = lines[0].split(":", 1)[1].split() if lines else []
    except OSError:
        # No /proc (not Linux): trust torch's own dispatch level.
        level = torch.backends.cpu.get_cpu_capability()
        return [] if level.startswith(("AVX2", "AVX512")) else ["avx2", "fma", "f16c"]
    return [name for name in ("avx2", "fma", "f16c") if name not in flags]


def build_directory() -> Path:
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(FLAGS).encode())
    for source in sorted(CSRC.glob("*.[ch]*")):  # headers too: a change rebuilds
        digest.update(source.read_bytes())
    return cache_dir() / f"cpu-ops-{digest.hexdigest()[:16]}"


def load_cpu_ops() -> Any:
    """`torch.ops.pagedllm_cpu`, compiled on first use; a failure is remembered, so a
    process tries (and warns) once."""
    global _ops, _error
    with _lock:
        if _ops is None and _error is None:
            try:
                _ops = _load()
            except KernelUnavailableError as exc:
                _error = exc
        if _error is not None:
            raise _error
        return _ops


def _load() -> Any:
    missing = missing_cpu_features()
    if missing:
        raise KernelUnavailableError(f"this CPU lacks {', '.join(missing)}")
    directory = build_directory()
    library = directory / f"{NAME}.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return torch.ops.pagedllm_cpu
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    # torch's build runs `ninja`: the one installed next to this Python counts too.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    logger.info("compiling the CPU kernels (once; cached in %s) ...", directory)
    start = time.perf_counter()
    try:
        cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers, a failed build: all mean "not here"
        detail = str(exc).strip().splitlines()
        raise KernelUnavailableError(
            f"building them failed ({type(exc).__name__}: {detail[-1] if detail else ''})"
        ) from exc
    logger.info("CPU kernels built in %.0f s", time.perf_counter() - start)
    return torch.ops.pagedllm_cpu
