"""Building and loading the compiled CPU attention kernel (csrc/paged_attention_cpu.cpp).

The C++ source ships inside the package and is compiled at first use with torch's
extension tools (`-O3 -mavx2 -mfma -mf16c -fopenmp`), once per source, torch version and
flags: the library is cached under `$PAGEDLLM_CACHE_DIR` (default ~/.cache/pagedllm) and
later processes just load it. `load_cpu_kernel()` returns the op or raises
KernelUnavailableError saying why (no AVX2/FMA/F16C, no compiler, a failed build), so that
the caller can fall back to the reference backend.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger("pagedllm")
SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.cpp"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17"]
NAME = "pagedllm_cpu_attention"
_lock = threading.Lock()
_op: Callable[..., None] | None = None


class KernelUnavailableError(RuntimeError):
    """The compiled kernel cannot be used here; the message says why."""


def cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pagedllm"
    )
    return Path(root) / "kernels"


def missing_cpu_features() -> list[str]:
    """The instruction sets the kernel needs that this CPU lacks (empty: it can run)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [f"an x86-64 CPU (this is {platform.machine()})"]
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:
        # No /proc (not Linux): trust torch's own dispatch level.
        level = torch.backends.cpu.get_cpu_capability()
        return [] if level.startswith(("AVX2", "AVX512")) else ["avx2", "fma", "f16c"]
    return [name for name in ("avx2", "fma", "f16c") if name not in flags]


def build_directory() -> Path:
    key = hashlib.sha256(
        SOURCE.read_bytes() + torch.__version__.encode() + " ".join(FLAGS).encode()
    ).hexdigest()[:16]
    return cache_dir() / f"cpu-attention-{key}"


def load_cpu_kernel() -> Callable[..., None]:
    """The op `paged_attention(out, query, k_cache, v_cache, block_tables,
    query_start_loc, context_lens, scale)`, compiled on first use."""
    global _op
    with _lock:
        if _op is None:
            _op = _load()
        return _op


def _load() -> Callable[..., None]:
    missing = missing_cpu_features()
    if missing:
        raise KernelUnavailableError(f"this CPU lacks {', '.join(missing)}")
    directory = build_directory()
    library = directory / f"{NAME}.so"
    if library.exists():
        torch.ops.load_library(str(library))
        return torch.ops.pagedllm_cpu.paged_attention
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    # torch's build runs `ninja`: the one installed next to this Python counts too.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    logger.info("compiling the CPU attention kernel (once; cached in %s) ...", directory)
    start = time.perf_counter()
    try:
        cpp_extension.load(
            name=NAME,
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers, a failed build: all mean "not here"
        detail = str(exc).strip().splitlines()
        raise KernelUnavailableError(
            f"building it failed ({type(exc).__name__}: {detail[-1] if detail else ''})"
        ) from exc
    logger.info("CPU attention kernel built in %.0f s", time.perf_counter() - start)
    return torch.ops.pagedllm_cpu.paged_attention
