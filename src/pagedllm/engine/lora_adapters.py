"""LoRAAdapters: the LoRA adapters an engine has been asked to run, keyed by their id.

An id names one adapter for the engine's whole life: the prefix cache and the pool's
adapter pages are keyed by it, so the same id with another path is refused, and an id
that was removed is never taken again (blocks cached under it must not be reused under a
different adapter). Each adapter's files are checked, and its page count found, once, by
the runner (against the base model and max_lora_rank). Used on the engine's thread only,
as the runner is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.errors import InvalidParameterError
from pagedllm.lora.request import LoRARequest


@dataclass(frozen=True)
class KnownAdapter:
    lora_id: int
    name: str
    path: str
    pages: int  # pool pages its weights take


class LoRAAdapters:
    def __init__(self, enabled: bool, pages_of: Callable[[str], int]) -> None:
        """`pages_of(path)`: the pool pages of the adapter at `path`, InvalidParameterError
        if it does not fit the base model (the runner's check)."""
        self.enabled = enabled
        self._pages_of = pages_of
        self._known: dict[int, KnownAdapter] = {}
        self._retired: set[int] = set()

    def check(self, lora_request: LoRARequest) -> KnownAdapter:
        """The adapter `lora_request` names, its files checked the first time; an
        InvalidParameterError naming the field if it cannot run here."""
        if not self.enabled:
            raise InvalidParameterError(
                "lora_request", "this engine runs no LoRA adapters: start it with enable_lora"
            )
        lora_id, path = lora_request.lora_int_id, lora_request.lora_path
        if lora_id in self._retired:
            raise InvalidParameterError(
                "lora_int_id",
                f"lora_int_id {lora_id} belonged to a removed adapter: ids are not reused",
            )
        known = self._known.get(lora_id)
        if known is None:
            pages = self._pages_of(path)
            known = self._known[lora_id] = KnownAdapter(
                lora_id, lora_request.lora_name, path, pages
            )
        elif known.path != path:
            raise InvalidParameterError(
                "lora_int_id",
                f"lora_int_id {lora_id} is the adapter at {known.path!r}, not {path!r}: "
                "each adapter needs its own id",
            )
        return known

    def retire(self, lora_id: int) -> bool:
        """Forget the adapter `lora_id` for good; False if it was not known."""
        if self._known.pop(lora_id, None) is None:
            return False
        self._retired.add(lora_id)
        return True
