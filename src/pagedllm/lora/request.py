"""LoRARequest: which adapter a request runs under, in vLLM's shape.

`lora_name` is what clients call it (the server's `model` field), `lora_int_id` the
engine's key for it (positive and unique per adapter: the prefix cache and the pool's
adapter pages are keyed by it; 0 is the base model), `lora_path` the PEFT directory
(`adapter_config.json` and `adapter_model.safetensors`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import InvalidParameterError
from pagedllm.validation import check_int


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidParameterError("lora_name", "lora_name must be a non-empty string")
        lora_int_id = check_int(
            self.lora_int_id, "lora_int_id", min=1, allowed="an integer >= 1 (0 is the base)"
        )
        # A plain int: the id keys the prefix cache's hashes and the adapter pages.
        object.__setattr__(self, "lora_int_id", lora_int_id)
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidParameterError("lora_path", "lora_path must be a non-empty path")
