"""pagedllm's Llama and Qwen2 logits against transformers' (the oracle) on tiny random
models: a prefill then 20 decode steps through a paged cache, for several block sizes."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import load_hf
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.loader import load_model
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.worker.kv_cache import PagedKVCache


def run_paged(path, prompts: list[list[int]], steps: int, block_size: int) -> list[torch.Tensor]:
    """Logits of every sequence at the prompt's end and after each of `steps` decodes,
    feeding back the oracle's own continuation (argmax of our logits)."""
    loaded = load_model(str(path))
    model = LlamaForCausalLM(loaded.config)
    model.load_weights(loaded.weights)
    total = max(map(len, prompts)) + steps + 1
    per_seq = -(-total // block_size)
    num_blocks = per_seq * len(prompts) + 3
    cache = PagedKVCache(loaded.config, num_blocks, block_size)
    # Shuffled physical blocks: the tables are deliberately non-contiguous.
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    logits_per_step = []
    computed = [0] * len(seqs)
    for _ in range(steps + 1):
        meta = build_attention_metadata(
            start_positions=computed,
            query_lens=[len(s) - c for s, c in zip(seqs, computed, strict=True)],
            block_tables=tables,
            logits_seq_indices=range(len(seqs)),
            block_size=block_size,
        )
        ids = torch.tensor([t for s, c in zip(seqs, computed, strict=True) for t in s[c:]])
        hidden = model(ids, meta.positions, cache.layers, meta)
        logits = model.compute_logits(hidden[meta.logits_indices])
        logits_per_step.append(logits)
        computed = [len(s) for s in seqs]
        for s, row in zip(seqs, logits, strict=True):
            s.append(int(row.argmax()))
    return logits_per_step, seqs


def assert_logits_match(path, block_size: int, steps: int = 20) -> None:
    """Our logits equal transformers' (within 1e-4) after three prompts whose lengths
    straddle block boundaries for every block size under test, and over `steps` decodes."""
    g = torch.Generator().manual_seed(block_size)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (13, 31, 40)]
    ours, seqs = run_paged(path, prompts, steps, block_size)
    hf = load_hf(path)
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            ref = hf(torch.tensor([seq[:-1]])).logits[0]
            n = len(prompts[i])
            for step in range(steps + 1):
                diff = (ours[step][i] - ref[n - 1 + step]).abs().max().item()
                assert diff < 1e-4, f"{path.name} seq {i} step {step}: max abs diff {diff}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_logits_match_transformers(arch, block_size, tiny_llama_dir, tiny_qwen2_dir) -> None:
    assert_logits_match(tiny_llama_dir if arch == "llama" else tiny_qwen2_dir, block_size)
