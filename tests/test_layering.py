"""The house layering, read from the source with `ast`: bookkeeping (kv/, core/), the
engine loop (engine/) and the runner interface are plain Python without torch, in their
imports and in their type annotations; model/ never reaches into scheduling, blocks or the
engine; each package imports only the packages below it (ALLOWED), lazily or not, so
that layers point one way; no two modules import each other, even lazily; only the
engine reads its scheduler and its block pool (everything else reads its snapshots)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedllm"
HEAVY = {"torch", "numpy", "np", "transformers", "Tensor"}
TORCH_FREE = [
    "kv",
    "core",
    "engine",
    "worker/runner.py",
    "worker/fake_runner.py",
    "worker/batch_tables.py",
    "worker/options.py",
    "kernels/policy.py",
    "errors.py",
    "bounded_json.py",
    "cache_root.py",
    "validation.py",
    "spec/__init__.py",
    "spec/ngram.py",
    "spec/config.py",
    "lora/__init__.py",
    "lora/request.py",
]
EVERYTHING = "*"
# What each part of the package may import from the others (module prefixes): lower
# layers never import higher ones. The worker speaks with the scheduler in its plain-data
# output alone, and gets its own options (worker/options.py), not the engine's config.
ALLOWED: dict[str, set[str] | str] = {
    "errors": set(),
    "bounded_json": set(),
    "cache_root": set(),
    "validation": {"errors"},  # the one integer check, for every layer
    "sampling_params": {"errors", "bounded_json", "validation"},
    "kv": {"errors", "validation"},
    "core": {"kv", "errors", "sampling_params", "validation"},
    "kernels": {"errors", "cache_root"},
    "attention": {"kernels", "errors"},
    "model": {"attention", "kernels", "errors", "validation"},
    "loader": {"model", "errors", "cache_root"},
    # LoRA adapters: PEFT files and the low-rank products a model applies on its rows
    "lora": {"model", "loader", "errors", "validation"},
    "worker": {
        "core.scheduler_output",
        "lora",
        "attention",
        "model",
        "kernels",
        "loader",
        "errors",
        "sampling_params",
        "structured",
        "validation",
    },
    # structured output's grammars (xgrammar): the engine imports them lazily
    "structured": {"errors", "sampling_params"},
    # speculative decoding: proposers and their config (the verifier runs in the worker)
    "spec": {"errors", "sampling_params", "validation"},
    "engine": {
        "core",
        "kv",
        "worker",
        "loader",
        "errors",
        "sampling_params",
        "structured",
        "spec",
        "lora",
        "validation",
    },
    "entrypoints": EVERYTHING,
    "bench": EVERYTHING,
    "__init__": EVERYTHING,
}


def files_of(part: str) -> list[Path]:
    path = SRC / part
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


def imports_in(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # maybe submodules
    return names


def annotations_in(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            args += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
            found += [ast.unparse(a.annotation) for a in args if a.annotation is not None]
            if node.returns is not None:
                found.append(ast.unparse(node.returns))
        elif isinstance(node, ast.AnnAssign):
            found.append(ast.unparse(node.annotation))
    return found


@pytest.mark.parametrize("part", TORCH_FREE)
def test_bookkeeping_has_no_torch(part: str) -> None:
    for path in files_of(part):
        heavy = {n for n in imports_in(path) if n.split(".")[0] in HEAVY}
        assert not heavy, f"{path.relative_to(SRC)} imports {heavy}"
        for annotation in annotations_in(path):
            words = set(annotation.replace(".", " ").replace("[", " ").replace("|", " ").split())
            assert not words & HEAVY, f"{path.relative_to(SRC)} annotates with {annotation}"


@pytest.mark.parametrize("package", ["model", "attention"])
def test_model_does_not_import_scheduling(package: str) -> None:
    banned = ("pagedllm.core", "pagedllm.kv", "pagedllm.engine", "pagedllm.worker")
    for path in files_of(package):
        bad = {n for n in imports_in(path) if n.startswith(banned)}
        assert not bad, f"{path.relative_to(SRC)} imports {bad}"


def part_of(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def test_every_part_has_a_row_in_the_table() -> None:
    assert {part_of(p) for p in SRC.rglob("*.py")} == set(ALLOWED)


@pytest.mark.parametrize("part", sorted(k for k, v in ALLOWED.items() if v != EVERYTHING))
def test_imports_point_down(part: str) -> None:
    allowed = ALLOWED[part]
    for path in SRC.rglob("*.py"):
        if part_of(path) != part:
            continue
        tree = ast.parse(path.read_text())
        relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
        assert not relative, f"{path.relative_to(SRC)}: relative imports hide their layer"
        for name in imports_in(path):
            if not name.startswith("pagedllm.") or name.split(".")[1] == part:
                continue
            inner = name.removeprefix("pagedllm.")
            ok = any(inner == a or inner.startswith(a + ".") for a in allowed)
            assert ok, f"{path.relative_to(SRC)} imports {name}: {part} may import {allowed}"


def test_the_worker_takes_only_plain_data_from_the_scheduler() -> None:
    for path in files_of("worker"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pagedllm.core"):
                names = {a.name for a in node.names}
                assert names == {"SchedulerOutput"}, f"{path.relative_to(SRC)} imports {names}"


# The engine's insides: the scheduler and the block pool, by the classes and by the
# attributes that hold them (`engine.scheduler`, `engine.kv`, `kv.allocator`).
ENGINE_INSIDES = {
    "pagedllm.core.scheduler.Scheduler",
    "pagedllm.kv.manager.KVCacheManager",
    "pagedllm.kv.allocator",
    "pagedllm.kv.block_table.BlockTable",
    "pagedllm.kv.sequence_blocks",
}
ENGINE_INSIDE_ATTRIBUTES = {"scheduler", "kv", "allocator"}
HOLDS_THE_INSIDES = {"engine", "core", "kv"}


@pytest.mark.parametrize("part", sorted(set(ALLOWED) - HOLDS_THE_INSIDES))
def test_only_the_engine_reads_the_scheduler_and_the_pool(part: str) -> None:
    for path in SRC.rglob("*.py"):
        if part_of(path) != part:
            continue
        names = imports_in(path)
        inside = {n for n in names if any(n == i or n.startswith(i + ".") for i in ENGINE_INSIDES)}
        assert not inside, f"{path.relative_to(SRC)} imports {inside}: read the engine's snapshot"
        attributes = {
            node.attr
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INSIDE_ATTRIBUTES
        }
        assert not attributes, f"{path.relative_to(SRC)} reads .{attributes}: read a snapshot"


def test_nothing_outside_the_engine_reaches_through_a_client() -> None:
    """`x.engine.engine` is an AsyncLLMEngine's LLMEngine: outside engine/ the engine is
    used through its protocols (engine/engine_client.py), which say what runs where."""
    for path in SRC.rglob("*.py"):
        if part_of(path) == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "engine"
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "engine"
            ):
                raise AssertionError(
                    f"{path.relative_to(SRC)}:{node.lineno} reaches through .engine.engine: "
                    "use the engine client's protocols (engine/engine_client.py)"
                )


def test_no_import_cycles_between_modules() -> None:
    """Imports inside the package, lazy ones included, form no cycle: a cycle makes
    import order matter and hides which layer depends on which."""
    modules = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = path
    graph = {
        name: {m for m in imports_in(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for dep in graph[name]:
            if state.get(dep) == 1:
                cycle = trail[trail.index(dep) :] if dep in trail else [dep]
                raise AssertionError(f"import cycle: {' -> '.join([*cycle, dep])}")
            if dep not in state:
                visit(dep, [*trail, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
