"""Time a decode step of the default model (SmolLM2-135M GGUF) with 32 rows: on the base,
under 32 distinct rank-8 q/v adapters, and under 32 distinct rank-16 adapters on all seven
targets; prints each step's fastest seconds and its ratio to the base step.

Not a test (it times the machine): `PYTHONPATH=src python scripts/lora_step_timing.py`.
The scenarios take turns of TURN decode steps (a shared machine slows them alike), the
first step of a turn untimed (it rebuilds the adapters' stacks). The base is timed twice:
as it runs (GGUF layers in one compiled call where the kernels build) and step by step,
the path rows under an adapter take.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.bench.lora_adapters import AdapterSpec, write_random_adapter
from pagedllm.core.scheduler_output import AdapterLoad, ScheduledSeq, SchedulerOutput
from pagedllm.lora.peft_config import TARGETS
from pagedllm.worker.factory import build_runner
from pagedllm.worker.options import RunnerOptions

BLOCK = 16
TURN = 3  # consecutive decode steps of a scenario, the stacks built at the first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its own)")
    args = parser.parse_args()
    if args.threads:  # on a shared machine, one thread times steadier
        torch.set_num_threads(args.threads)
    runner, _ = build_runner(RunnerOptions(enable_lora=True, max_lora_rank=16))
    cfg = runner.model_config
    n, ctx, rounds = args.rows, args.context, args.rounds
    steps = rounds * TURN
    per_seq = -(-(ctx + steps + 1) // BLOCK)
    adapter_pages = runner.max_adapter_pages(BLOCK)
    runner.init_kv_cache(4 * n * per_seq + 2 * n * adapter_pages, BLOCK)
    root = Path(tempfile.mkdtemp(prefix="lora-timing-"))
    next_page = 4 * n * per_seq
    scenarios: dict[str, dict[int, tuple[str, tuple[int, ...]]]] = {
        "base": {},
        "base step by step": {},
    }
    for name, r, targets in (
        ("32 x q,v r8", 8, ("q_proj", "v_proj")),
        ("32 x all r16", 16, TARGETS),
    ):
        adapters = {}
        for i in range(n):
            lora_id = len(scenarios) * 100 + i + 1
            spec = AdapterSpec(rank=r, targets=targets, alpha=2 * r)
            path = write_random_adapter(cfg, str(root / f"{lora_id}"), spec, lora_id)
            pages = runner.adapter_pages(path, BLOCK)
            adapters[lora_id] = (path, tuple(range(next_page, next_page + pages)))
            next_page += pages
        scenarios[name] = adapters
    fused = runner.model.fused_gguf
    # Each scenario its own 32 sequences and blocks; the scenarios' decode steps take turns,
    # so that a busy machine slows them alike; the fastest of each is kept.
    per_seq = -(-(ctx + steps + 1) // BLOCK)
    states = []
    for s_index, (name, adapters) in enumerate(scenarios.items()):
        runner.model.fused_gguf = None if name == "base step by step" else fused
        ids = list(adapters) or [0] * n
        pages = {i: p for i, (_, p) in adapters.items()}
        loads = tuple(AdapterLoad(i, path, p) for i, (path, p) in adapters.items())
        first = s_index * n
        seqs = tuple(
            ScheduledSeq(
                f"r{first + k}",
                first + k,
                tuple((7 * k + j) % cfg.vocab_size for j in range(ctx)),
                0,
                (tuple(range((first + k) * per_seq, (first + k + 1) * per_seq)),),
                True,
                lora_id=ids[k],
            )
            for k in range(n)
        )
        step = SchedulerOutput(seqs, {}, (), (), lora_loads=loads, lora_pages=pages)
        runner.forward(step, runner.input_batch.step_tables(step))  # prefill, untimed
        states.append((name, first, ids, pages))
    times: dict[str, list[float]] = {name: [] for name, *_ in states}
    pos = dict.fromkeys(times, 0)
    for _ in range(rounds):
        for name, first, ids, pages in states:
            runner.model.fused_gguf = None if name == "base step by step" else fused
            for turn in range(TURN):
                s = pos[name]
                pos[name] += 1
                seqs = tuple(
                    ScheduledSeq(
                        f"r{first + k}",
                        first + k,
                        (k + s,),
                        ctx + s,
                        ((),),
                        True,
                        (),
                        False,
                        ids[k],
                    )
                    for k in range(n)
                )
                step = SchedulerOutput(seqs, {}, (), (), lora_pages=pages)
                start = time.perf_counter()
                runner.forward(step, runner.input_batch.step_tables(step))
                if turn:  # a turn's first step rebuilds the adapters' stacks
                    times[name].append(time.perf_counter() - start)
    results = {name: min(t) for name, t in times.items()}
    base = results["base"]
    print(f"threads {torch.get_num_threads()}, {n} rows, context {ctx}")
    print(f"fused GGUF layers on the base: {fused is not None}")
    for name, t in results.items():
        print(f"{name:20s} {t * 1000:8.2f} ms  x{t / base:.2f}")


if __name__ == "__main__":
    main()
