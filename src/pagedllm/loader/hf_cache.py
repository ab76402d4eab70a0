"""Models named as the Hugging Face hub names them (`org/name`), found in the local cache.

`--model HuggingFaceTB/SmolLM2-135M-Instruct` loads the snapshot that `hf download` (or
transformers) left in the cache; nothing is downloaded. The cache is $HF_HUB_CACHE, else
$HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub (~/.cache by default), laid out as
`models--org--name/snapshots/<revision>/` with `refs/main` naming the revision in use.
A snapshot of a GGUF repository (no config.json) loads its one .gguf file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pagedllm.errors import ModelLoadError

# One part of a name as the hub allows it: letters, digits, "-", "_", "."; neither "-"
# nor "." first or last, and no "--" or ".." (so never a path's "." or "..").
_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")


def is_repo_id(name: str) -> bool:
    """Whether `name` is spelled as a hub model name, `org/name`."""
    parts = name.split("/")
    return len(parts) == 2 and all(
        _PART.fullmatch(p) and "--" not in p and ".." not in p for p in parts
    )


def hub_cache_dir() -> tuple[Path, str]:
    """The hub cache folder, and the setting it came from (for messages)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser(), "$HF_HUB_CACHE"
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub", "$HF_HOME/hub"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "huggingface" / "hub", "$XDG_CACHE_HOME"
    return Path("~/.cache/huggingface/hub").expanduser(), "the default"


def find_in_hub_cache(repo_id: str) -> str:
    """The local path of `repo_id`'s cached snapshot (a folder, or its one .gguf file);
    ModelLoadError saying where it looked if the cache does not hold it."""
    cache, source = hub_cache_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))

    def missing(why: str) -> ModelLoadError:
        return ModelLoadError(
            f"the model '{repo_id}' is neither a local path nor in the Hugging Face cache "
            f"at {cache} (from {source}): {why}; nothing is downloaded: fetch it with "
            f"`hf download {repo_id}`, or give a local path"
        )

    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        raise missing(f"{snapshots} does not exist")
    ref = repo / "refs" / "main"
    if ref.is_file():
        revision = ref.read_text(encoding="utf-8").strip()
        folder = snapshots / revision
        if Path(revision).name != revision or not folder.is_dir():  # a name, not a path
            raise missing(f"refs/main names {revision!r}, which {snapshots} lacks")
    else:
        found = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
        if len(found) != 1:
            held = ", ".join(found) or "none"
            raise missing(f"{repo} has no refs/main to choose among its snapshots ({held})")
        folder = snapshots / found[0]
    return _model_in(folder)


def _model_in(folder: Path) -> str:
    """A snapshot's model: the folder itself (config.json), or its one GGUF file."""
    if (folder / "config.json").is_file():
        return str(folder)
    ggufs = sorted(p for p in folder.rglob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return str(ggufs[0])
    if ggufs:
        names = ", ".join(str(p.relative_to(folder)) for p in ggufs)
        raise ModelLoadError(
            f"{folder} holds several GGUF files ({names}): give the path of the one to load"
        )
    raise ModelLoadError(f"{folder} has neither a config.json nor a .gguf file to load")
