"""Where pagedllm keeps what it builds once and reuses across processes: the compiled
kernels, the int8 GEMM choices, the tokenizers built from GGUF files. The folder is
`$PAGEDLLM_CACHE_DIR`, by default ~/.cache/pagedllm; deleting it only costs rebuilding.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(
        os.environ.get("PAGEDLLM_CACHE_DIR")
        or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
    )
