"""Prompt log-probabilities (SamplingParams.prompt_logprobs) from a step's final hidden
states: the flat batch rows a PromptLogprobsRow scores, and their float32 log_softmax,
a few hundred positions' logits at a time, keeping only the asked-for values.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.worker.runner import PromptLogprobs, PromptLogprobsRow

# Prompt positions whose logits are computed at once for prompt log-probabilities: 256 x
# a 49,152-token vocabulary is 48 MiB of float32.
PROMPT_LOGITS_ROWS = 256


def prompt_positions(
    query_lens: Sequence[int], prompt_rows: Sequence[PromptLogprobsRow]
) -> torch.Tensor:
    """The rows of a step's flat batch (sequence i's tokens are `query_lens[i]` rows on
    from the previous ones') that the prompt rows score, row after row, on the host."""
    offsets = torch.zeros(len(query_lens), dtype=torch.long)
    torch.cumsum(torch.as_tensor(query_lens[:-1], dtype=torch.long), 0, out=offsets[1:])
    seq_index = torch.tensor([r.seq_index for r in prompt_rows], dtype=torch.long)
    counts = torch.tensor([len(r.target_ids) for r in prompt_rows], dtype=torch.long)
    firsts = offsets[seq_index] + torch.tensor([r.first for r in prompt_rows], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(prompt_rows)), counts)
    starts = torch.cumsum(counts, 0) - counts  # each row's first entry in the result
    return firsts[owner] + torch.arange(owner.numel()) - starts[owner]


def score_prompts(
    model: LlamaForCausalLM,
    hidden: torch.Tensor,
    query_lens: Sequence[int],
    prompt_rows: Sequence[PromptLogprobsRow],
) -> list[PromptLogprobs]:
    """Each row's prompt tokens scored from the step's final hidden states, at most
    PROMPT_LOGITS_ROWS positions' logits at a time: a long prompt's chunk never holds
    [chunk, vocab] logits at once. Under tensor parallelism every rank computes the
    same logits (their gathers pair up) and only rank 0, which holds the whole
    vocabulary's, scores them (the others return nothing)."""
    positions = prompt_positions(query_lens, prompt_rows).to(hidden.device)
    targets = torch.tensor(
        list(itertools.chain.from_iterable(r.target_ids for r in prompt_rows)),
        dtype=torch.long,
        device=hidden.device,
    )
    scores = model.parallel is None or model.parallel.rank == 0
    k = max(r.num_logprobs for r in prompt_rows)
    chosen, top_lp, top_ids = [], [], []
    for a in range(0, positions.numel(), PROMPT_LOGITS_ROWS):
        b = a + PROMPT_LOGITS_ROWS
        logits = model.compute_logits(hidden[positions[a:b]])
        if not scores:
            continue
        logprobs = logits.float().log_softmax(dim=-1)
        chosen.append(logprobs.gather(1, targets[a:b, None])[:, 0])
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            top_lp.append(values)
            top_ids.append(ids)
    if not scores:
        return []
    lp = torch.cat(chosen).tolist()
    n = len(lp)
    ids_l = torch.cat(top_ids).tolist() if k else [[] for _ in range(n)]
    top_l = torch.cat(top_lp).tolist() if k else [[] for _ in range(n)]
    out = []
    end = 0
    for r in prompt_rows:
        a, end = end, end + len(r.target_ids)
        ids, tops = ids_l[a:end], top_l[a:end]
        if r.num_logprobs < k:
            ids = [x[: r.num_logprobs] for x in ids]
            tops = [x[: r.num_logprobs] for x in tops]
        out.append(PromptLogprobs(lp[a:end], ids, tops))
    return out
