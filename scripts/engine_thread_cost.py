"""Why the server builds its engine on the loop thread: the time per generated token of one
128-token request (128-token prompt, batch 1, default model), with the engine

  main    built and stepped on the main thread (offline use),
  other   built on the main thread and stepped on a second one,
  loop    built and stepped on its own loop thread (AsyncLLMEngine.build, as `pagedllm
          serve` does), its outputs read by an asyncio consumer,

each in a fresh process. libgomp keeps a worker team per thread that ran a parallel
region; in `other` there are two teams on the machine's cores.
    .venv/bin/python scripts/engine_thread_cost.py
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

CASES = ("main", "other", "loop")
PROMPT = list(range(1000, 1128))


def per_token_ms(case: str) -> float:
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    config = EngineConfig(kv_cache_memory="256MiB", enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)

    def decode(engine: LLMEngine, request_id: str) -> float:
        engine.add_request(request_id, PROMPT, params)
        engine.step()  # the prefill
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return 1000 * (time.perf_counter() - start) / steps

    if case == "loop":
        async_engine = AsyncLLMEngine.build(lambda: LLMEngine(config))

        async def consume(request_id: str) -> float:
            stream = await async_engine.add_request(request_id, PROMPT, params)
            first, count = 0.0, 0
            async for _ in stream:
                count += 1
                first = first or time.perf_counter()
            return 1000 * (time.perf_counter() - first) / (count - 1)

        asyncio.run(consume("warm-up"))
        result = asyncio.run(consume("timed"))
        async_engine.shutdown()
        return result
    engine = LLMEngine(config)
    decode(engine, "warm-up")  # on the main thread: its worker team now exists
    if case == "main":
        return decode(engine, "timed")
    times: list[float] = []
    thread = threading.Thread(target=lambda: times.append(decode(engine, "timed")))
    thread.start()
    thread.join()
    return times[0]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        print(f"{per_token_ms(sys.argv[2]):.2f}")
        return
    print("| engine | ms per token |\n|---|---|")
    for case in CASES:
        cmd = [sys.executable, __file__, "--case", case]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        print(f"| {case} | {out.split()[-1]} |")


if __name__ == "__main__":
    main()
