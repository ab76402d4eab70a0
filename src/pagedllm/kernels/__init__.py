"""Compiled CPU kernels (C++ sources in csrc/, built at first use) with their loader.

`cpu.load_cpu_ops()` returns the `torch.ops.pagedllm_cpu` namespace: paged attention that
follows the block table in place, the int8 linear layer, linear layers on GGUF quantized
blocks (`gguf_blocks.py`; not used by the engine yet), and the fused element-wise ops of a
decoder layer. Every op the engine uses has a pure-torch counterpart that is the tested
fallback.
"""
