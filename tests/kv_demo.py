"""Workloads for the KV view's browser tests and screenshots: a busy server over a fake
runner (1,456 blocks, up to 200 sequences: 100+ requests, samples, beams, shared prefixes)
that can be frozen mid-run, and a recorded beam search."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from typing import Any

from inspect_internals import pause, resume
from live_server import LiveServer
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.kv_trace import KVTrace
from pagedllm.engine.listeners import StepListener
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.snapshot import EngineSnapshot
from pagedllm.entrypoints.server.app import create_app
from pagedllm.errors import RequestFailedError
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec

VOCAB = 1000


def busy_server(num_blocks: int = 1456, **app: Any) -> LiveServer:
    config = EngineConfig(
        num_kv_blocks=num_blocks, block_size=16, max_num_seqs=200, max_num_batched_tokens=4096
    )
    engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(VOCAB, 8192, (0,)), seed=1))
    return LiveServer(create_app(engine, served_model_name="fake", **app))


def start_load(live: LiveServer, count: int = 400, seed: int = 0) -> threading.Thread:
    """Queue `count` requests in a thread of their own: prompts from a few shared prefixes,
    mostly plain sampling, some n = 2 or 4, some beam searches of width 4. The thread ends
    when they are done or the server is closed."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(32, 96))] for _ in range(6)]
    requests = []
    for i in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 80))]
        params: Any
        if i % 10 == 9:
            params = BeamSearchParams(
                beam_width=4, max_tokens=rng.randint(30, 200), ignore_eos=True
            )
        else:
            n = rng.choice([1, 1, 1, 1, 1, 2, 4])
            params = SamplingParams(n=n, max_tokens=rng.randint(30, 200), ignore_eos=True)
        requests.append((f"req-{i}", prompt, params))

    async def main() -> None:
        # Queue them all before the engine runs any: over a fake runner a request finishes
        # in milliseconds, sooner than the next one could be added.
        pause(live.engine)
        try:
            streams = [await live.engine.add_request(*r) for r in requests]
        finally:
            resume(live.engine)
        try:
            for stream in streams:
                async for _ in stream:
                    pass
        except RequestFailedError:
            pass  # the server was closed before the load ran out

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    return thread


class PauseWhenBusy(StepListener):
    """Pauses the engine at the end of the first step that ran `running` requests at once
    holding `used_blocks` (on the engine's thread: no step can slip past unseen)."""

    def __init__(self, live: LiveServer, running: int, used_blocks: int) -> None:
        self.live, self.running, self.used_blocks = live, running, used_blocks
        self.busy = threading.Event()

    def on_step_end(self, step: Any, outputs: Any, ran: EngineSnapshot) -> None:
        if self.busy.is_set() or ran.num_running < self.running:
            return
        if ran.usage.used_blocks >= self.used_blocks:
            pause(self.live.engine)
            self.busy.set()


def freeze_when_busy(live: LiveServer, running: int = 100, used_blocks: int = 1100) -> None:
    """Pause the engine once `running` requests run at once and hold `used_blocks` (it
    keeps its state); returns when no step is in progress any more."""
    watch = PauseWhenBusy(live, running, used_blocks)
    remove = asyncio.run(live.engine.call(lambda: live.engine.engine.add_listener(watch)))
    assert watch.busy.wait(120), "the load never got busy"  # a hang guard, not a timing
    # A command runs between steps, and after pause() no step follows it.
    asyncio.run(live.engine.call(remove))


def record_beam_search(
    path: Path, model: str | None = None, prompt: str | list[int] = "The capital of France is"
) -> dict[str, Any]:
    """A KV trace of one beam search (width 4) on `model` (default: the default model)."""
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(model, num_kv_blocks=48, block_size=4)
    trace = KVTrace.record(llm.engine, text=True, command=f"beam search of {prompt!r}")
    llm.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=20), use_tqdm=False)
    return trace.write(path)
