"""Real prompts for the benches: the ShareGPT JSON format that vLLM's benchmarks read, and
`copy`, chat prompts over the text the package ships whose answers copy their input.

The file is a list of `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
"value": ...}, ...]}`. The first human turn is the prompt; the token count of the first
gpt turn after it is the output length. vLLM's filters apply: the prompt and the output
at least 4 tokens, the prompt at most 1024, prompt + output at most 2048 (and at most
the context). Conversations are shuffled with the seed, and the first usable ones taken.
A file that is not JSON is an error naming the file and the position; entries of the
wrong shape are skipped, with a warning saying how many.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from pagedllm.bench.workload import BenchRequest
from pagedllm.entrypoints.server.chat_template import encode_chat
from pagedllm.errors import InvalidParameterError

logger = logging.getLogger("pagedllm")
MIN_TOKENS, MAX_PROMPT, MAX_TOTAL = 4, 1024, 2048
SHIPPED_TEXT = Path(__file__).parent / "data" / "quality_text.txt"
COPY_CHARS = 600  # of each paragraph: a prompt of about 150 tokens


def shipped_paragraphs() -> list[str]:
    """The paragraphs of the text the package ships that are long enough to copy (over 200
    characters), in order."""
    text = SHIPPED_TEXT.read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]


def copy_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` chat prompts (token ids) asking the model to repeat a paragraph of the text
    the package ships, the longest paragraphs first, cycled when there are fewer: outputs
    that copy their inputs, where prompt-lookup speculation pays."""
    paragraphs = sorted(shipped_paragraphs(), key=len, reverse=True)
    return [
        encode_chat(
            tokenizer,
            [{"role": "user", "content": f"Repeat this text exactly:\n\n{p[:COPY_CHARS]}"}],
            True,
        )
        for p in (paragraphs[i % len(paragraphs)] for i in range(count))
    ]


def copy_requests(tokenizer: Any, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """The `copy` dataset: `copy_prompts` as token ids (both servers of a comparison read
    the same ids), each with `output_len` tokens to generate."""
    return [BenchRequest(tuple(ids), output_len) for ids in copy_prompts(tokenizer, num_prompts)]


def _turns(entry: Any) -> tuple[str, str] | None:
    """The first human turn and the gpt turn that answers it, or None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
        return None
    turns = entry["conversations"]
    for i, turn in enumerate(turns[:-1]):
        reply = turns[i + 1]
        if not (isinstance(turn, dict) and isinstance(reply, dict)):
            return None
        if turn.get("from") == "human" and reply.get("from") == "gpt":
            prompt, answer = turn.get("value"), reply.get("value")
            return (prompt, answer) if isinstance(prompt, str) and isinstance(answer, str) else None
    return None


def sharegpt_requests(
    path: str, tokenizer: Any, num_prompts: int, seed: int, max_model_len: int
) -> list[BenchRequest]:
    """`num_prompts` requests from a ShareGPT file (fewer, with a warning, if it has fewer
    usable conversations)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidParameterError("dataset_path", f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(
            "dataset_path",
            f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
        ) from None
    if not isinstance(data, list):
        raise InvalidParameterError("dataset_path", f"{path} must hold a JSON list")
    pairs = [_turns(entry) for entry in data]
    malformed = sum(p is None for p in pairs)
    usable = [p for p in pairs if p is not None]
    random.Random(seed).shuffle(usable)
    requests: list[BenchRequest] = []
    too_short_or_long = 0
    for prompt, answer in usable:
        if len(requests) == num_prompts:
            break
        prompt_ids = tokenizer.encode(prompt)
        output_len = len(tokenizer.encode(answer, add_special_tokens=False))
        total = len(prompt_ids) + output_len
        if (
            min(len(prompt_ids), output_len) < MIN_TOKENS
            or len(prompt_ids) > MAX_PROMPT
            or total > min(MAX_TOTAL, max_model_len)
        ):
            too_short_or_long += 1
            continue
        requests.append(BenchRequest(tuple(prompt_ids), output_len, prompt_text=prompt))
    if malformed:
        logger.warning(
            "%s: skipped %d entries that are not ShareGPT conversations", path, malformed
        )
    if len(requests) < num_prompts:
        logger.warning(
            "%s: %d usable conversations, fewer than the %d asked for (%d filtered by length)",
            path,
            len(requests),
            num_prompts,
            too_short_or_long,
        )
    if not requests:
        raise InvalidParameterError("dataset_path", f"{path} has no usable conversation")
    return requests
