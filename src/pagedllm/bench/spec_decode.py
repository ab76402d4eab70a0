"""`pagedllm bench spec`: what speculative decoding buys at one stream.

A workload whose outputs copy their inputs (the model is asked to repeat paragraphs of
the text the package ships, bench/data/quality_text.txt), run one request at a time,
greedy, without speculation and then with `--speculative-method ngram` (default k 4,
prompt lookup 2..4 when the flags are not given) or, with `--speculative-method draft
--speculative-model M [--speculative-quantization int8]`, a draft model's proposals.
Per mode: time per output token (TPOT: from the first token to the last, per token),
tokens per second, the acceptance rate and the mean accepted length; and whether the
tokens equal those without speculation (greedy: they must).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

from pagedllm.bench import options
from pagedllm.bench.datasets import copy_prompts
from pagedllm.bench.output import ratio, write_outputs
from pagedllm.bench.sweep import engine_over_runner
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.engine_args import engine_options
from pagedllm.sampling_params import SamplingParams

COLUMNS = (
    "mode=mode|tpot_ms=TPOT ms|tokens_per_s=tokens/s|steps=steps|acceptance_rate=accepted"
    "|mean_accepted_length=tokens per check|same_tokens=same tokens as off"
)
NGRAM_DEFAULTS = dict(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "spec",
        help="speculative decoding (n-gram, or a draft model) at one stream: TPOT with vs without",
    )
    options.add_bench_args(p, "spec", run, engine={"kv_cache_memory": "1GiB"})
    p.add_argument("--num-prompts", type=int, default=4, help="paragraphs repeated, one at a time")
    p.add_argument("--max-tokens", type=int, default=96)


def one_stream(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Each prompt alone, greedy: its tokens, TPOTs and the engine's steps."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokens, tpots, steps, generated, seconds = [], [], 0, 0, 0.0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, params)
        first = None
        out = None
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if outputs:
                first = first or time.perf_counter()
                out = outputs[-1]
            steps += 1
        end = time.perf_counter()
        assert out is not None and first is not None
        ids = out.outputs[0].token_ids
        tokens.append(ids)
        generated += len(ids)
        seconds += end - start
        if len(ids) > 1:
            tpots.append((end - first) / (len(ids) - 1))
    return {
        "tokens": tokens,
        "tpot": statistics.mean(tpots),
        "steps": steps,
        "tokens_per_s": generated / seconds,
    }


SPEC_KEYS = (
    "speculative_method",
    "speculative_model",
    "speculative_quantization",
    *NGRAM_DEFAULTS,
)


def speculation_options(opts: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The speculation the flags ask for (n-gram with its bench defaults unless
    `--speculative-method draft`), and its label in the table."""
    k = opts.get("num_speculative_tokens") or NGRAM_DEFAULTS["num_speculative_tokens"]
    if opts.get("speculative_method") == "draft" or opts.get("speculative_model"):
        spec = {
            "speculative_method": "draft",
            "num_speculative_tokens": k,
            "speculative_model": opts.get("speculative_model"),
            "speculative_quantization": opts.get("speculative_quantization", "auto"),
        }
        quant = spec["speculative_quantization"]
        quant = "" if quant == "auto" else f" {quant}"
        return spec, f"draft {spec['speculative_model']}{quant} k={k}"
    spec = {"speculative_method": "ngram"} | {
        key: v if opts.get(key) is None else opts[key] for key, v in NGRAM_DEFAULTS.items()
    }
    label = f"ngram k={k} lookup {spec['prompt_lookup_min']}..{spec['prompt_lookup_max']}"
    return spec, label


def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = options.get_loaded(args.model)
    opts = engine_options(args)
    spec_opts, spec_label = speculation_options(opts)
    unset = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for key in SPEC_KEYS:
        opts[key] = unset[key]
    rows, base = [], None
    for mode, extra in (("off", {}), (spec_label, spec_opts)):
        engine, _ = engine_over_runner(EngineConfig(**(opts | extra)), loaded)
        prompts = copy_prompts(engine.tokenizer, args.num_prompts)
        one_stream(engine, prompts[:1], 4)  # warm-up
        got = one_stream(engine, prompts, args.max_tokens)
        snap = engine.snapshot()
        base = got if base is None else base
        rows.append(
            {
                "mode": mode,
                "tpot_ms": round(got["tpot"] * 1000, 2),
                "tokens_per_s": round(got["tokens_per_s"], 1),
                "steps": got["steps"],
                "acceptance_rate": round(snap.spec_acceptance_rate, 3) if extra else None,
                "mean_accepted_length": round(snap.spec_mean_accepted_length, 2) if extra else None,
                "same_tokens": got["tokens"] == base["tokens"],
            }
        )
        engine.shutdown()
    config = dict(
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        threads=torch.get_num_threads(),
        **spec_opts,
    )
    notes = [
        "one request at a time, greedy; prompts ask the model to repeat a paragraph of "
        "bench/data/quality_text.txt, so its output copies its input",
        "TPOT: (last token - first token) / (tokens - 1), mean over requests; includes "
        "scheduling, proposing, verification and output processing",
    ]
    result = options.new_result("spec", args, loaded, config, rows, notes)
    result["summary"] = {
        "tpot_speedup": ratio(rows[0]["tpot_ms"], rows[1]["tpot_ms"]),
        "same_tokens": rows[1]["same_tokens"],
    }
    result["exit_code"] = 0 if rows[1]["same_tokens"] else 1
    return write_outputs(result, args.out, COLUMNS)
