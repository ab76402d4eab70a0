"""What an engine replica (entrypoints/ray_serve/replica.py) sends per token, run in
process without Ray: a stream's outputs are deltas, so after the first (which carries
the prompt once) the bytes Ray pickles per token do not grow with the prompt."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

from pagedllm.engine.config import EngineConfig
from pagedllm.entrypoints.ray_serve.replica import EngineReplica
from pagedllm.entrypoints.server.protocol import CompletionRequest

MAX_TOKENS = 12


def sent_bytes(replica: EngineReplica, prompt: list[int]) -> tuple[int, float]:
    """(bytes of the first item sent, bytes per token of the others) for one request
    as the server streams it."""
    body = CompletionRequest(
        prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stream=True
    )

    async def items() -> list[bytes]:
        calls = replica.generate([("r", prompt, body.sampling_params())])
        assert await calls.__anext__() is None  # queued
        return [pickle.dumps(item) async for item in calls]

    sent = asyncio.run(items())
    assert len(sent) == MAX_TOKENS  # one output per token
    return len(sent[0]), sum(map(len, sent[1:])) / (MAX_TOKENS - 1)


def test_bytes_per_token_do_not_grow_with_the_prompt(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), block_size=16, num_kv_blocks=64)
    replica = EngineReplica(config)
    try:
        first_short, short = sent_bytes(replica, list(range(1, 9)))
        first_long, long = sent_bytes(replica, [1 + i % 100 for i in range(400)])
    finally:
        replica.engine.shutdown()
    assert first_long - first_short >= 392  # the prompt, sent once
    assert abs(long - short) < 8  # per token: the same, whatever the prompt's length
