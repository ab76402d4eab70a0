"""What structured output costs, with xgrammar on SmolLM2's tokenizer (49,152 tokens):

compile  the time to compile each kind of grammar (a cold compile, then a cache hit),
mask     per decode step: filling one row's bitmask and applying the masks of a batch
         to its logits (one call for the whole batch),
engine   the median time per step of a batch of 8 requests, every one constrained by
         a JSON schema vs the same batch unconstrained, on the real SmolLM2-135M.

  .venv/bin/python scripts/structured_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch
import xgrammar as xgr

from pagedllm import LLM, SamplingParams, StructuredOutputs
from pagedllm.loader import default_model_path
from pagedllm.loader.tokenizer import load_gguf_tokenizer
from pagedllm.structured.grammar import GrammarCompiler, GrammarState

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age"],
}
KINDS = {
    "json schema": StructuredOutputs(json=SCHEMA),
    "json object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=r"[A-Z][a-z]{2,8} [0-9]{1,4}(-[a-z]+)?"),
    "choice": StructuredOutputs(choice=["positive", "negative", "neutral"]),
    "ebnf": StructuredOutputs(grammar='root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'),
}


def timed(fn, repeat: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def mask_cost(state: GrammarState, batch: int) -> str:
    bitmask = xgr.allocate_token_bitmask(batch, 49152)
    fill = timed(lambda: state.fill_bitmask(bitmask, 0), 200)
    logits = torch.randn(batch, 49152)
    rows = list(range(batch))
    apply = timed(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows), 50)
    return f"fill one row {fill * 1e6:6.1f} us, apply to all rows {apply * 1e6:7.1f} us"


def main() -> None:
    tokenizer = load_gguf_tokenizer(default_model_path(), None)
    built = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, 49152, {tokenizer.eos_token_id})
    print(f"tokenizer info (once per engine): {time.perf_counter() - built:.2f} s")
    for name, spec in KINDS.items():
        cold = timed(lambda spec=spec: compiler.compile(spec))
        hit = timed(lambda spec=spec: compiler.compile(spec), 100)
        print(f"compile {name:12s} cold {cold * 1e3:7.1f} ms   cached {hit * 1e6:5.1f} us")

    state = compiler.matcher(compiler.compile(KINDS["json schema"]))
    brace = tokenizer.convert_tokens_to_ids("{")
    accept = timed(lambda: (state.accept(brace), state.rollback(1)), 200)  # taken back
    print(f"accept + rollback one token: {accept * 1e6:.1f} us")
    for batch in (1, 8, 32):
        print(f"batch {batch:2d}: " + mask_cost(state, batch))

    llm = LLM(None, max_num_seqs=8)
    engine = llm.engine
    prompts = [f"Describe person number {i} as JSON:" for i in range(8)]
    # Interleaved rounds: on a shared machine the load changes between runs.
    for round_ in range(2):
        for name, spec in (("plain", None), ("json schema", KINDS["json schema"])):
            params = SamplingParams(
                max_tokens=24, ignore_eos=spec is None, seed=0, structured_outputs=spec
            )
            llm.generate(prompts[:1], params, use_tqdm=False)  # warm up (and compile)
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{round_}-{name}-{i}", prompt, params)
            times = []
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            median = statistics.median(times) * 1e3
            print(f"engine, batch of 8, {name:11s}: median step {median:.1f} ms")


if __name__ == "__main__":
    main()
