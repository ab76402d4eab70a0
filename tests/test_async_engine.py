"""AsyncLLMEngine: outputs equal the synchronous engine's, the idle loop sleeps, failures
stay contained (one bad request, one failed step), and leaving a stream early aborts the
request and frees its blocks."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from inspect_internals import loop_running, pause, resume
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.request_stream import RequestStream
from pagedllm.entrypoints.llm import LLM
from pagedllm.errors import EngineOverloadedError, EngineStoppedError, RequestFailedError
from pagedllm.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120] * 2]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)


@pytest.fixture
def make_engine(tiny_llama_dir: Path) -> Iterator[Callable[..., AsyncLLMEngine]]:
    made: list[AsyncLLMEngine] = []

    def make(max_waiting: int | None = None, **options: object) -> AsyncLLMEngine:
        config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, **options)
        engine = AsyncLLMEngine(LLMEngine(config), max_waiting=max_waiting)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


async def run_to_end(
    engine: AsyncLLMEngine, rid: str, prompt: list[int], params: SamplingParams = GREEDY
) -> list[int]:
    final = None
    async for out in await engine.add_request(rid, prompt, params):
        final = out
    assert final is not None and final.finished
    return final.outputs[0].token_ids


async def last(stream: RequestStream) -> RequestOutput:
    outs = [out async for out in stream]
    return outs[-1]


async def used_blocks(engine: AsyncLLMEngine) -> int:
    # call() runs after every command submitted before it (aborts included).
    return await engine.call(lambda: engine.engine.kv.usage().used_blocks)


def test_outputs_equal_the_offline_engine(make_engine, tiny_llama_dir: Path) -> None:
    engine = make_engine()

    async def main() -> list[list[int]]:
        return await asyncio.gather(
            *(run_to_end(engine, f"r{i}", p) for i, p in enumerate(PROMPTS))
        )

    got = asyncio.run(main())
    offline = LLM(str(tiny_llama_dir), num_kv_blocks=64).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in offline]
    assert engine.snapshot.usage.used_blocks == 0


def test_build_makes_the_engine_on_the_loop_thread(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64)
    built_on: list[threading.Thread] = []

    def make() -> LLMEngine:
        built_on.append(threading.current_thread())
        return LLMEngine(config)

    engine = AsyncLLMEngine.build(make)
    try:
        assert built_on[0] is not threading.current_thread()
        assert loop_running(engine)
        stepped_on = asyncio.run(engine.call(threading.current_thread))
        assert stepped_on is built_on[0]
        got = asyncio.run(run_to_end(engine, "a", PROMPTS[0]))
        offline = LLM(str(tiny_llama_dir), num_kv_blocks=64).generate(
            PROMPTS[0], GREEDY, use_tqdm=False
        )
        assert got == offline[0].outputs[0].token_ids
        assert engine.snapshot.usage.used_blocks == 0
    finally:
        engine.shutdown()
    assert not loop_running(engine)

    def fail() -> LLMEngine:
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        AsyncLLMEngine.build(fail)
    with pytest.raises(ValueError, match="max_waiting must be an integer >= 0, got -1"):
        AsyncLLMEngine.build(fail, max_waiting=-1)  # refused before building anything


def test_idle_loop_does_not_spin(make_engine) -> None:
    engine = make_engine()
    engine.start()
    time.sleep(0.2)
    assert engine.num_iterations == 0  # started, nothing to do: asleep

    async def main() -> None:
        await run_to_end(engine, "a", PROMPTS[0])
        await used_blocks(engine)

    asyncio.run(main())
    iterations, steps = engine.num_iterations, engine.snapshot.num_steps
    assert steps >= GREEDY.max_tokens
    time.sleep(0.3)
    assert (engine.num_iterations, engine.snapshot.num_steps) == (iterations, steps)
    assert loop_running(engine) and engine.healthy


def test_exception_in_one_request_fails_only_that_request(make_engine, monkeypatch) -> None:
    engine = make_engine()
    real_add = engine.engine.add_request

    def add_request(request_id: str, *args: object, **kwargs: object) -> None:
        if request_id == "bad":
            raise RuntimeError("tokenizer exploded")
        real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(engine.engine, "add_request", add_request)

    async def main() -> tuple[list[object], int]:
        results = await asyncio.gather(
            run_to_end(engine, "good0", PROMPTS[0]),
            run_to_end(engine, "bad", PROMPTS[1]),
            run_to_end(engine, "good1", PROMPTS[2]),
            return_exceptions=True,
        )
        return results, await used_blocks(engine)

    results, used = asyncio.run(main())
    assert isinstance(results[1], RuntimeError) and "exploded" in str(results[1])
    assert [len(r) for r in (results[0], results[2])] == [12, 12]
    assert used == 0 and engine.healthy


def test_failed_step_fails_its_requests_and_the_loop_serves_on(make_engine, monkeypatch) -> None:
    engine = make_engine(max_num_seqs=1)  # one request runs, the next one waits
    runner = engine.engine.runner
    real_execute = runner.execute
    failed = []

    # the model fails mid-decode of the victim
    def execute(step, rows, grammar_bitmask=None, prompt_rows=()):
        victim = engine.engine.scheduler.requests.get("victim")
        if not failed and victim is not None and victim.seqs[0].num_output_tokens >= 3:
            failed.append(True)
            raise RuntimeError("CUDA error: device-side assert")
        return real_execute(step, rows, grammar_bitmask, prompt_rows)

    monkeypatch.setattr(runner, "execute", execute)

    async def main() -> tuple[list[object], list[int], int]:
        results = await asyncio.gather(
            run_to_end(engine, "victim", PROMPTS[0]),
            run_to_end(engine, "bystander", PROMPTS[1]),
            return_exceptions=True,
        )
        after = await run_to_end(engine, "later", PROMPTS[1])
        return results, after, await used_blocks(engine)

    (victim, bystander), after, used = asyncio.run(main())
    assert isinstance(victim, RequestFailedError) and "device-side assert" in str(victim)
    assert bystander == after and len(after) == 12
    assert used == 0 and not engine.engine.has_unfinished_requests()


def test_cancelling_the_consumer_aborts_and_frees_blocks(make_engine) -> None:
    engine = make_engine()

    async def main() -> tuple[int, int, bool]:
        got = []

        async def consume() -> None:
            async for out in await engine.add_request("long", PROMPTS[2], LONG):
                got.append(out)

        task = asyncio.create_task(consume())
        while len(got) < 3:
            await asyncio.sleep(0.001)
        held = await used_blocks(engine)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return held, await used_blocks(engine), engine.engine.has_unfinished_requests()

    held, used, unfinished = asyncio.run(main())
    assert held > 0
    assert used == 0 and not unfinished


def test_leaving_a_stream_early_aborts_it(make_engine) -> None:
    engine = make_engine()

    async def main() -> int:
        async with await engine.add_request("r", PROMPTS[2], LONG) as stream:
            async for out in stream:
                if len(out.outputs[0].token_ids) == 2:
                    break
        return await used_blocks(engine)

    assert asyncio.run(main()) == 0
    assert not engine.engine.has_unfinished_requests()


def test_max_waiting_bounds_only_the_requests_beyond_what_can_be_admitted(make_engine) -> None:
    engine = make_engine(max_waiting=1, max_num_seqs=2)
    pause(engine)  # nothing is scheduled: requests stay waiting

    async def main() -> tuple[list[list[int]], int]:
        # Two sequence slots: two waiting requests could be admitted now, so they are not
        # a backlog; the third is the one request max_waiting=1 allows beyond them.
        streams = [await engine.add_request(f"r{i}", PROMPTS[0], GREEDY) for i in range(3)]
        assert (await engine.call(engine.engine.snapshot)).backlog == 1
        with pytest.raises(EngineOverloadedError, match="max_waiting=1"):
            await engine.add_request("refused", PROMPTS[1], GREEDY)
        resume(engine)
        finals = [(await last(s)).outputs[0].token_ids for s in streams]
        return finals, await used_blocks(engine)

    finals, used = asyncio.run(main())
    assert [len(ids) for ids in finals] == [12, 12, 12] and used == 0


def test_every_request_of_a_group_counts_against_max_waiting(make_engine) -> None:
    """A group is queued whole only if it leaves the backlog within max_waiting: two
    sequence slots and max_waiting=3 take a group of 5, not one of 6, and none of it."""
    engine = make_engine(max_waiting=3, max_num_seqs=2)
    pause(engine)

    async def main() -> int:
        group = [(f"big{i}", PROMPTS[0], GREEDY) for i in range(6)]
        with pytest.raises(EngineOverloadedError, match="these 6 requests would leave 4"):
            await engine.add_requests(group)
        assert not engine.engine.has_unfinished_requests()  # all or nothing
        stream = await engine.add_requests(group[:5])
        assert (await engine.call(engine.engine.snapshot)).backlog == 3
        resume(engine)
        finals = [out async for out in stream if out.finished]
        assert len(finals) == 5
        return await used_blocks(engine)

    assert asyncio.run(main()) == 0


def test_requests_added_together_share_one_stream(make_engine) -> None:
    engine = make_engine()

    async def main() -> tuple[dict[str, list[int]], list[int], int]:
        stream = await engine.add_requests([(f"g{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
        finals = {}
        async for out in stream:
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        alone = await run_to_end(engine, "alone", PROMPTS[2])
        return finals, alone, await used_blocks(engine)

    finals, alone, used = asyncio.run(main())
    assert sorted(finals) == ["g0", "g1", "g2"] and finals["g2"] == alone
    assert used == 0


def test_a_group_is_added_all_or_none_and_aborted_together(make_engine) -> None:
    engine = make_engine()

    async def main() -> tuple[bool, int]:
        with pytest.raises(ValueError, match="max_model_len"):  # the second cannot fit
            await engine.add_requests([("a", PROMPTS[0], LONG), ("b", [1] * 600, LONG)])
        none_left = not await engine.call(engine.engine.has_unfinished_requests)
        group = [("c", PROMPTS[0], LONG), ("d", PROMPTS[2], LONG)]
        async with await engine.add_requests(group) as stream:
            async for out in stream:
                if len(out.outputs[0].token_ids) == 2:
                    break  # leaving the block early aborts both
        return none_left, await used_blocks(engine)

    none_left, used = asyncio.run(main())
    assert none_left and used == 0
    assert not engine.engine.has_unfinished_requests()


def test_bad_request_raises_value_error(make_engine) -> None:
    engine = make_engine()

    async def main() -> None:
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("big", [1] * 600, GREEDY)
        assert len(await run_to_end(engine, "ok", PROMPTS[0])) == 12

    asyncio.run(main())


def test_shutdown_fails_unfinished_requests(make_engine) -> None:
    engine = make_engine()
    pause(engine)

    async def main() -> None:
        stream = await engine.add_request("r", PROMPTS[0], GREEDY)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(RequestFailedError, match="shut down"):
            async for _ in stream:
                pass

    asyncio.run(main())
    assert engine.engine.kv.usage().used_blocks == 0
    assert not engine.engine.has_unfinished_requests()


def test_drain_refuses_new_requests_and_end_unfinished_frees_the_running(make_engine) -> None:
    engine = make_engine()

    async def main() -> None:
        stream = await engine.add_request("r", PROMPTS[0], LONG)
        await stream.__anext__()  # running: it holds blocks
        pause(engine)  # so that it cannot finish by itself
        engine.drain()
        with pytest.raises(EngineStoppedError, match="no new request"):
            await engine.add_request("new", PROMPTS[1], GREEDY)
        engine.end_unfinished("ended by the test")
        with pytest.raises(EngineStoppedError, match="ended by the test"):
            async for _ in stream:
                pass

    asyncio.run(main())
    assert engine.engine.kv.usage().used_blocks == 0
    assert not engine.engine.has_unfinished_requests()
