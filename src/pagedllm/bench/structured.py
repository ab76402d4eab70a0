"""`pagedllm bench structured`: what grammar-constrained decoding costs per step.

For each batch size it times the engine's decode steps with every request held to a JSON
schema (an array of records: objects, bounded strings, numbers and enums, long enough that
no request ends inside the timed steps) against the same batch and prompts unconstrained,
in the same run, alternating the two for `--rounds` rounds (the machine's load drifts). A
constrained step also fills each row's token bitmask and masks the logits; the ratio is
that cost. Then it times compiling each grammar of a test set (JSON schema, JSON object,
regex, choice, EBNF, a tool call) on the model's tokenizer: cold, and from the cache.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from pagedllm.bench import options
from pagedllm.bench.engine_benches import engine_for, random_prompts
from pagedllm.bench.output import median_seconds, ratio, write_outputs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams, StructuredOutputs
from pagedllm.structured.grammar import GrammarCompiler

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age"],
}
# Decoded under the grammar: many records, so that a request runs past the timed steps.
DECODE_SCHEMA = {"type": "array", "items": RECORD, "minItems": 64}
TOOL_CALL = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
        "required": ["name", "parameters"],
    },
}
GRAMMARS = {
    "json schema": StructuredOutputs(json=RECORD),
    "json object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=r"[A-Z][a-z]{2,8} [0-9]{1,4}(-[a-z]+)?"),
    "choice": StructuredOutputs(choice=["positive", "negative", "neutral"]),
    "ebnf": StructuredOutputs(grammar='root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'),
    "tool call (required)": StructuredOutputs(json=TOOL_CALL),
}
COLUMNS = "|".join(
    [
        "batch=batch",
        "plain_ms=unconstrained step ms",
        "structured_ms=JSON-schema step ms",
        "ratio=ratio",
        "extra_us_per_row=extra us per row",
    ]
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("structured", help="step cost of grammar masks; grammar compile times")
    options.add_bench_args(p, "structured", run, engine={"kv_cache_memory": "1GiB"})
    text = "default: 1,16,32,64"
    p.add_argument("--batch-sizes", type=options.int_list, default="1,16,32,64", help=text)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per batch and mode")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two modes")


def step_seconds(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Median seconds of the decode steps of `prompts` under `params` (after the prefill),
    the requests run to their end."""
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    started: set[str] = set()
    while len(started) < len(prompts):  # prefill until every request is decoding
        started.update(out.request_id for out in engine.step())
    steps = (params.max_tokens or 3) - 2
    seconds, _ = median_seconds(engine.step, steps)
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


def compile_times(engine: LLMEngine) -> dict[str, float]:
    """Cold and cached compile times of each grammar, on a compiler of its own (a cold
    compile runs in a worker process, as the server's)."""
    compiler = GrammarCompiler(
        engine.tokenizer,
        engine.vocab_size,
        engine.eos_token_ids,
        cache_bytes=int(engine.config.grammar_cache_mb * 2**20),
    )
    compiler.compile(StructuredOutputs(regex="[a-z]"))  # its workers started
    times: dict[str, float] = {}
    for name, spec in GRAMMARS.items():
        start = time.perf_counter()
        compiler.compile(spec)
        times[f"compile {name}, cold (ms)"] = round((time.perf_counter() - start) * 1e3, 2)
        start = time.perf_counter()
        for _ in range(100):
            compiler.compile(spec)
        times[f"compile {name}, cached (us)"] = round((time.perf_counter() - start) * 1e4, 1)
    compiler.close()
    return times


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict[str, Any]:
    batches = args.batch_sizes
    engine, _, loaded = engine_for(args, max(batches))
    schema = StructuredOutputs(json=DECODE_SCHEMA)
    engine.compile_grammar(schema)  # compiled before the timed steps, as the server does
    max_tokens = args.steps + 2  # one warm-up step, then the timed ones
    modes = {
        "plain": SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        "structured": SamplingParams(
            temperature=0, max_tokens=max_tokens, structured_outputs=schema
        ),
    }
    vocab = loaded.config.vocab_size
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for batch in batches:
            prompts = random_prompts(vocab, batch, args.prompt_len, args.seed)
            for mode, params in modes.items():
                times.setdefault((batch, mode), []).append(step_seconds(engine, prompts, params))
    rows = []
    for batch in batches:
        plain = statistics.median(times[batch, "plain"])
        constrained = statistics.median(times[batch, "structured"])
        rows.append(
            {
                "batch": batch,
                "plain_ms": round(plain * 1e3, 2),
                "structured_ms": round(constrained * 1e3, 2),
                "ratio": ratio(constrained, plain, 3),
                "extra_us_per_row": round((constrained - plain) / batch * 1e6, 1),
            }
        )
    summary = compile_times(engine)
    whole = engine.snapshot().usage.used_blocks == 0
    engine.shutdown()
    config = {"prompt_len": args.prompt_len, "steps": args.steps, "rounds": args.rounds}
    config |= {"threads": torch.get_num_threads()}
    notes = [
        "median decode step (scheduling, forward, masks, sampling, output processing) after "
        "the prefill; the two modes alternate on the same prompts, the median over rounds",
        "constrained: every request held to an array of at least 64 records (objects with "
        "bounded strings, integers, enums), greedy",
        "compile: a fresh compiler on the model's tokenizer; cached: a hit in its LRU",
    ]
    if not whole:
        notes.append("the KV pool was not whole at the end")
    result = options.new_result("structured", args, loaded, config, rows, notes)
    result["summary"] = summary
    return write_outputs(result, args.out, COLUMNS)
