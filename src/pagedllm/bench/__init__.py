"""Benchmarks: the seed's performance table measured on this engine.

`workload.py` makes seeded request sets; `throughput`, `memory`, `block_size`,
`attention` and `latency` are the `pagedllm bench` subcommands; `report` runs a standard
suite and writes docs/benchmarks.md. Everything is measured side by side in one process.
"""
