"""The LoRA adapters a server serves, by the name clients give as `model` (vLLM's shape).

`parse_lora_modules` reads `--lora-modules` (`name=path`, or vLLM's JSON form
`{"name": ..., "path": ...}`); `ServedModels` holds the base model's names and the
adapters (the `--lora-modules` ones get lora_int_id 1, 2, ... in order; each adapter
loaded later takes the next id, never one used before, so that the engine's prefix cache
and pool pages, keyed by id, can not mix two adapters); `check_lora_path` keeps a runtime
load inside `--lora-dir`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pagedllm.entrypoints.server.responses import ModelCard
from pagedllm.errors import InvalidParameterError
from pagedllm.lora import LoRARequest


@dataclass(frozen=True)
class LoRAModule:
    """An adapter to serve from the start: clients select it as `model: name`."""

    name: str
    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "=" in self.name:
            raise InvalidParameterError(
                "lora_modules",
                f"a LoRA module's name must be a non-empty string without '=', got {self.name!r}",
            )
        if not isinstance(self.path, str) or not self.path:
            raise InvalidParameterError(
                "lora_modules", f"the LoRA module {self.name!r} needs a non-empty path"
            )


def parse_lora_module(text: str) -> LoRAModule:
    """One `--lora-modules` value: `name=path` or `{"name": ..., "path": ...}`."""
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise InvalidParameterError(
                "lora_modules", f"the LoRA module {text!r} is not valid JSON: {exc}"
            ) from None
        if not isinstance(data, dict) or not {"name", "path"} <= set(data):
            raise InvalidParameterError(
                "lora_modules",
                f'a JSON LoRA module needs "name" and "path", got {text!r}',
            )
        unknown = set(data) - {"name", "path", "base_model_name"}
        if unknown:
            raise InvalidParameterError(
                "lora_modules",
                f"a JSON LoRA module takes name, path and base_model_name; got {sorted(unknown)}",
            )
        return LoRAModule(data["name"], data["path"])
    name, sep, path = text.partition("=")
    if not sep:
        raise InvalidParameterError(
            "lora_modules", f"a LoRA module is name=path or JSON, got {text!r}"
        )
    return LoRAModule(name, path)


def parse_lora_modules(values: Sequence[str] | None) -> tuple[LoRAModule, ...]:
    """Every `--lora-modules` value; each name once."""
    modules = tuple(parse_lora_module(v) for v in values or ())
    names = [m.name for m in modules]
    for name in names:
        if names.count(name) > 1:
            raise InvalidParameterError(
                "lora_modules", f"the LoRA module name {name!r} is given more than once"
            )
    return modules


def module_requests(modules: Sequence[LoRAModule]) -> list[LoRARequest]:
    """The `--lora-modules` adapters as LoRARequests: lora_int_id 1, 2, ... in order."""
    return [LoRARequest(m.name, i, m.path) for i, m in enumerate(modules, start=1)]


def check_lora_path(lora_path: object, lora_dir: str) -> str:
    """`lora_path` resolved (a relative path is taken under `lora_dir`), if it lies inside
    `lora_dir` once every symlink and `..` is resolved, and none of its files links out
    of it; InvalidParameterError naming `lora_path` otherwise (a load must not read
    adapters from anywhere on the host)."""
    if not isinstance(lora_path, str) or not lora_path:
        raise InvalidParameterError("lora_path", "lora_path must be a non-empty path")
    if "\x00" in lora_path:
        raise InvalidParameterError("lora_path", "lora_path must not hold a NUL character")
    root = os.path.realpath(lora_dir)
    resolved = os.path.realpath(os.path.join(root, lora_path))
    if os.path.commonpath([root, resolved]) != root or resolved == root:
        raise InvalidParameterError(
            "lora_path",
            f"lora_path {lora_path!r} is not inside the server's LoRA directory; "
            "give a folder under --lora-dir",
        )
    if not os.path.isdir(resolved):
        raise InvalidParameterError(
            "lora_path", f"lora_path {lora_path!r} is not a folder under the LoRA directory"
        )
    for name in os.listdir(resolved):  # the adapter's files too: none may link out
        target = os.path.realpath(os.path.join(resolved, name))
        if os.path.commonpath([root, target]) != root:
            raise InvalidParameterError(
                "lora_path",
                f"{name!r} in lora_path {lora_path!r} links outside the LoRA directory",
            )
    return resolved


class ServedModels:
    """The base model's names (`base_names`, the first echoed) and the adapters served
    beside it, by name."""

    def __init__(
        self, base_names: Sequence[str], base_path: str | None, modules: Sequence[LoRAModule] = ()
    ) -> None:
        self.base_names = tuple(base_names)
        self.base_path = base_path
        self._adapters: dict[str, LoRARequest] = {}
        self._last_id = 0
        for lora in module_requests(modules):
            self.add(lora)
        self._last_id = len(self._adapters)

    @property
    def base_name(self) -> str:
        return self.base_names[0]

    def __contains__(self, name: object) -> bool:
        return name in self.base_names or name in self._adapters

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.base_names) + len(self._adapters)

    def names(self) -> list[str]:
        return [*self.base_names, *self._adapters]

    def adapters(self) -> Iterator[LoRARequest]:
        return iter(list(self._adapters.values()))

    def cards(self, max_model_len: int | None) -> list[ModelCard]:
        """/v1/models: the base under each name, then each adapter (`parent`: the base)."""
        base = [
            ModelCard(id=n, root=self.base_path, max_model_len=max_model_len)
            for n in self.base_names
        ]
        return base + [
            ModelCard(
                id=a.lora_name, root=a.lora_path, parent=self.base_name, max_model_len=max_model_len
            )
            for a in self._adapters.values()
        ]

    def lora(self, name: str | None) -> LoRARequest | None:
        """The adapter named `name`; None for the base (or no name). KeyError if unknown."""
        if name is None or name in self.base_names:
            return None
        return self._adapters[name]

    def new_request(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest under a fresh id (not yet served: see `add`);
        InvalidParameterError naming `lora_name` if the name is taken."""
        self._check_free(name)
        self._last_id += 1
        return LoRARequest(name, self._last_id, path)

    def add(self, lora: LoRARequest) -> None:
        """Serve `lora` under its name (checked again: a load may have raced it)."""
        self._check_free(lora.lora_name)
        self._adapters[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest:
        """Stop serving the adapter `name`; KeyError if there is none."""
        return self._adapters.pop(name)

    def _check_free(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidParameterError("lora_name", "lora_name must be a non-empty string")
        if name in self.base_names:
            raise InvalidParameterError(
                "lora_name", f"{name!r} is the base model's name; give the adapter another"
            )
        if name in self._adapters:
            raise InvalidParameterError(
                "lora_name", f"the LoRA adapter {name!r} has already been loaded"
            )
