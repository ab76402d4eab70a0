"""LoRA adapters served over one base model: requests name an adapter, a step mixes rows
of several adapters and of the base, and adapters live in pages of the KV pool."""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
