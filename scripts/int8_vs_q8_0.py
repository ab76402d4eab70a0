"""Would an on-the-fly Q8_0 of float weights (a Hugging Face checkpoint's) supersede the
int8 W8A8 path? On the default model's float32 weights (as a checkpoint would hold them):
perplexity on the shipped text, and decode steps alternating between `--quantization int8`
and the same weights quantized to Q8_0 blocks at load and run on the GGUF kernels, with
the float32 engine as the baseline. Medians per batch size.
    .venv/bin/python scripts/int8_vs_q8_0.py [--batch-sizes 1,8,64] [--steps 12]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedllm import SamplingParams
from pagedllm.bench.quality import DATA, perplexity
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.loader import LoadedModel, load_model
from pagedllm.loader.gguf_loader import kept_as_blocks
from pagedllm.model.gguf_linear import GGUFWeight

PROMPT_LEN = 32


def as_q8_0(loaded: LoadedModel) -> LoadedModel:
    """`loaded` with every linear weight and the embedding quantized to Q8_0 blocks."""
    weights: dict[str, torch.Tensor | GGUFWeight] = {}
    for name, w in loaded.weights.items():
        if kept_as_blocks(name) and isinstance(w, torch.Tensor):
            blocks = gguf.quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
            weights[name] = GGUFWeight(
                torch.from_numpy(blocks), GGMLQuantizationType.Q8_0, w.shape[1]
            )
        else:
            weights[name] = w
    return dataclasses.replace(loaded, weights=weights, kept_quantized=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    dense = load_model()
    q8 = as_q8_0(dense)
    memory = "512MiB"
    engines = {
        "float32": LLMEngine(EngineConfig(quantization="none", kv_cache_memory=memory), dense),
        "int8": LLMEngine(EngineConfig(quantization="int8", kv_cache_memory=memory), dense),
        "Q8_0": LLMEngine(EngineConfig(quantization="gguf", kv_cache_memory=memory), q8),
    }
    text = (DATA / "quality_text.txt").read_text(encoding="utf-8")
    text_ids = dense.tokenizer.encode(text)
    ppl = {name: perplexity(e.runner.logits_of(text_ids), text_ids) for name, e in engines.items()}
    base = ppl["float32"]
    print(", ".join(f"{n} perplexity {p:.3f} ({p / base - 1:+.2%})" for n, p in ppl.items()))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [rng.integers(10, 40000, size=PROMPT_LEN).tolist() for _ in range(batch)]
        for engine in engines.values():
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{batch}-{i}", prompt, params)
            for _ in range(3):  # the prefill and the first decodes
                engine.step()
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.steps):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
        for engine in engines.values():
            while engine.has_unfinished_requests():
                engine.step()
        ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
        cells = ", ".join(f"{n} {v:.1f} ms ({v / ms['float32']:.2f}x)" for n, v in ms.items())
        print(f"batch {batch}: {cells}")


if __name__ == "__main__":
    main()
