"""Benchmarks: the vLLM paper's performance table, measured on this engine (`pagedllm
bench`, cli.py). The benches share one option builder (options.py), one sweep runner over
`LLMEngine.step()` (sweep.py) and one output writer (output.py)."""
