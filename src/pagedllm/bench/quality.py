"""`pagedllm bench quality`: what a numeric option changes, measured against the exact path
(weights dequantized to float32: quantization none; float32 KV cache).

The variant is the command line's options; its quantization "auto" is decided for the
model's file as an engine would decide it, so that with no option the bench measures the
default path (a quantized GGUF's blocks kept as stored) against the exact one. On a text
that ships with pagedllm (bench/data/quality_text.txt, about 3,000 tokens of plain English
prose written for this purpose) it measures each configuration's perplexity and the
largest logit difference from the baseline; on a set of 32 chat prompts, greedy agreement:
the share of prompts whose first 32 generated tokens are identical, and the share of those
tokens equal to the baseline's, position by position. Each configuration's runner is
built here, from the loaded model (loaded again with its blocks kept for quantization
gguf) and the configuration's runner options: the logits come from its public
`logits_of`, the greedy tokens from an engine over that same runner.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

from pagedllm.bench import options
from pagedllm.bench.output import write_outputs
from pagedllm.bench.sweep import engine_over_runner
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.engine_args import engine_options
from pagedllm.entrypoints.server.chat_template import encode_chat
from pagedllm.loader import LoadedModel
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.quantization_choice import resolve_quantization

DATA = Path(__file__).with_name("data")
COLUMNS = "|".join(
    [
        "system=configuration",
        "perplexity=perplexity",
        "perplexity_change=vs baseline",
        "max_logit_diff=max abs logit diff",
        "mean_logit_diff=mean abs logit diff",
        "greedy_agreement=greedy agreement",
        "same_greedy_tokens=same greedy tokens",
        "mean_common_prefix=same tokens before a change",
        "kv_bytes_per_token=KV bytes/token",
    ]
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("quality", help="perplexity and greedy agreement of an option vs exact")
    options.add_bench_args(p, "quality", run, engine={"kv_cache_memory": "256MiB"})
    p.add_argument("--text", default=str(DATA / "quality_text.txt"), help="perplexity text")
    p.add_argument("--prompts", default=str(DATA / "quality_prompts.txt"), help="one a line")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens compared per prompt")


# Rows of logits taken at a time: a large vocabulary's logits over the whole text take
# gigabytes (Gemma 3's 262,144 entries: 3 GB in fp32), so no copy of them all is made.
ROWS = 256


def perplexity(logits: torch.Tensor, text_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each next token under `logits`."""
    targets = torch.tensor(text_ids[1:])
    total = 0.0
    for start in range(0, len(targets), ROWS):
        logprobs = torch.log_softmax(logits[start : start + ROWS].double(), -1)
        picked = targets[start : start + ROWS, None]
        total += logprobs[: len(picked)].gather(1, picked).sum().item()
    return math.exp(-total / len(targets))


def logit_diffs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """The largest and the mean absolute difference of two logits tensors."""
    most, total = 0.0, 0.0
    for start in range(0, len(a), ROWS):
        diff = (a[start : start + ROWS] - b[start : start + ROWS]).abs()
        most, total = max(most, float(diff.max())), total + float(diff.double().sum())
    return most, total / a.numel()


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A prompt as the model takes it: in its chat template, or as plain text for a base
    model (one without a template)."""
    if getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return tokenizer.encode(text)


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The first `tokens` greedy tokens of each prompt (EOS allowed), in order."""
    params = SamplingParams(temperature=0, max_tokens=tokens)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    return [list(done[str(i)]) for i in range(len(prompts))]


def measure(
    config: EngineConfig,
    loaded: LoadedModel,
    text_ids: list[int],
    prompts: list[list[int]],
    tokens: int,
) -> dict:
    engine, runner = engine_over_runner(config, loaded)
    try:
        logits = runner.logits_of(text_ids)
        greedy = greedy_tokens(engine, prompts, tokens)
    finally:
        runner.shutdown()
    return {"logits": logits, "ppl": perplexity(logits, text_ids), "greedy": greedy}


def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = options.get_loaded(args.model)
    tokenizer = loaded.tokenizer
    text_ids = tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))
    lines = Path(args.prompts).read_text(encoding="utf-8").splitlines()
    prompts = [encode_prompt(tokenizer, q) for q in lines if q]
    variant = engine_options(args)
    # "auto" as an engine loading the file decides it, so that the row names the path.
    variant["quantization"] = resolve_quantization(
        EngineConfig(**variant).runner_options, args.model
    ).quantization
    baseline = {**variant, "dtype": "float32", "kv_cache_dtype": "float32", "quantization": "none"}
    rows, first = [], None
    for name, opts in (("baseline (exact, float32)", baseline), ("variant", variant)):
        engine_config = EngineConfig(**opts)  # checks the options before the model is built
        got = measure(engine_config, loaded, text_ids, prompts, args.tokens)
        first = first or got
        max_diff, mean_diff = logit_diffs(got["logits"], first["logits"])
        pairs = list(zip(got["greedy"], first["greedy"], strict=True))
        agree = sum(a == b for a, b in pairs)
        same = sum(x == y for a, b in pairs for x, y in zip(a, b, strict=False))
        total = sum(len(b) for _, b in pairs)
        prefix = sum(common_prefix(a, b) for a, b in pairs) / len(pairs)
        kv_bytes = options.kv_bytes_per_token(loaded, opts)
        label = name if name.startswith("baseline") else describe(opts)
        rows.append(
            {
                "system": label,
                "perplexity": round(got["ppl"], 4),
                "perplexity_change": f"{got['ppl'] / first['ppl'] - 1:+.2%}",
                "max_logit_diff": max_diff,
                "mean_logit_diff": mean_diff,
                "greedy_agreement": f"{agree}/{len(prompts)}",
                "same_greedy_tokens": f"{same / total:.1%}",
                "mean_common_prefix": round(prefix, 1),
                "kv_bytes_per_token": kv_bytes,
            }
        )
    config = {"text_tokens": len(text_ids), "prompts": len(prompts), "tokens": args.tokens}
    notes = [
        "perplexity over the shipped text (teacher forcing, chunks of 512 tokens through the "
        "paged cache); logit differences over every position and vocabulary entry",
        f"greedy agreement: prompts whose first {args.tokens} greedy tokens (in the chat "
        "template, if the model has one; EOS allowed) equal the baseline's; same greedy "
        "tokens: the share of the baseline's tokens the configuration generated at the same "
        "position; then how many tokens, on average, come before the first difference",
    ]
    result = options.new_result("quality", args, loaded, config, rows, notes)
    return write_outputs(result, args.out, COLUMNS)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def describe(opts: dict[str, Any]) -> str:
    """The options that differ from the exact path, e.g. `kv_cache_dtype=float16`."""
    exact = {"dtype": "float32", "kv_cache_dtype": "auto", "quantization": "none"}
    changed = [f"{k}={opts[k]}" for k, v in exact.items() if opts.get(k, v) != v]
    return ", ".join(changed) or "the same options"
