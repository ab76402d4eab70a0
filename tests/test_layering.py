"""The house layering, read from the imports with `ast`: bookkeeping (kv/, core/) is
plain Python without torch; model/ never reaches into scheduling, blocks or the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedllm"


def imports_of(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (SRC / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        found[str(path.relative_to(SRC))] = names
    return found


@pytest.mark.parametrize("package", ["kv", "core"])
def test_bookkeeping_has_no_torch(package: str) -> None:
    for path, names in imports_of(package).items():
        heavy = {n for n in names if n.split(".")[0] in {"torch", "numpy", "transformers"}}
        assert not heavy, f"{path} imports {heavy}"


@pytest.mark.parametrize("package", ["model", "attention"])
def test_model_does_not_import_scheduling(package: str) -> None:
    banned = ("pagedllm.core", "pagedllm.kv", "pagedllm.engine", "pagedllm.worker")
    for path, names in imports_of(package).items():
        bad = {n for n in names if n.startswith(banned)}
        assert not bad, f"{path} imports {bad}"
