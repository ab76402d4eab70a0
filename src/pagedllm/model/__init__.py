"""The decoder of every supported family (Llama, Mistral, Qwen2/3, Phi-3, Gemma 3), reading
and writing a paged KV cache.

Nothing here imports the scheduler, the block manager or the engine: a forward takes
its attention metadata as an argument.
"""

from pagedllm.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagedllm.model.llama import LlamaForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelConfig"]
