"""A plain decoder layer with int8 or GGUF weights runs as one compiled call
(model/fused_layer.py): the same bits as the layer's step-by-step forward, through chunked
prefill and decode steps, with and without a q/k/v bias, and only where every kernel it
chains applies."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from gguf_convert import write_gguf
from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu import missing_cpu_features
from tiny_gguf import write_tiny_llama_gguf

pytestmark = pytest.mark.skipif(bool(missing_cpu_features()), reason="no compiled kernels here")
PROMPTS = [list(range(1, 21)), [5, 6, 7], list(range(30, 70))]


@contextmanager
def step_by_step(model: Any) -> Iterator[None]:
    """The model's layers run step by step (no fused call) inside the block."""
    saved = [layer.fused for layer in model.layers], model.fused_gguf
    for layer in model.layers:
        layer.fused = None
    model.fused_gguf = None
    try:
        yield
    finally:
        for layer, fusion in zip(model.layers, saved[0], strict=True):
            layer.fused = fusion
        model.fused_gguf = saved[1]


def run(llm: LLM) -> tuple[list[list[int]], list[float], torch.Tensor]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [o.outputs[0].cumulative_logprob for o in outs]
    return tokens, logprobs, llm.engine.runner.logits_of(PROMPTS[2])


def _qwen2_q8_0_gguf(tmp_path: Path, request) -> Path:
    return write_gguf(request.getfixturevalue("tiny_qwen2_dir"), tmp_path / "q.gguf", "Q8_0")


def _llama_mixed_gguf(tmp_path: Path, request) -> Path:
    # q/k/v of three types in one fused layer; gate/up of one.
    kinds = dict(attn_q="Q8_0", attn_k="Q4_0", attn_v="Q4_1", attn_output="Q5_0")
    kinds |= dict(ffn_gate="Q4_1", ffn_up="Q4_1", ffn_down="Q8_0")
    write_tiny_llama_gguf(tmp_path / "l.gguf", kinds, context_length=256)
    return tmp_path / "l.gguf"


@pytest.mark.parametrize(
    ("model", "quantization"),
    [
        ("tiny_llama_dir", "int8"),
        ("tiny_qwen2_dir", "int8"),
        (_llama_mixed_gguf, "gguf"),
        (_qwen2_q8_0_gguf, "gguf"),  # a q/k/v bias
    ],
)
def test_fused_layers_give_the_step_by_step_bits(
    model: Any, quantization: str, request, tmp_path: Path
) -> None:
    path = request.getfixturevalue(model) if isinstance(model, str) else model(tmp_path, request)
    # Prompts longer than a step's token budget: prefill in chunks beside decodes. No
    # prefix caching: the step-by-step run must compute its prompts' K/V itself, not reuse
    # the fused run's (which would hide a wrong fused prefill).
    llm = LLM(
        str(path),
        quantization=quantization,
        num_kv_blocks=64,
        block_size=8,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    model = llm.engine.runner.model
    assert model.fused_layers == len(model.layers)
    assert (model.fused_gguf is not None) == (quantization == "gguf")  # all layers, one call
    fused = run(llm)
    with step_by_step(model):
        unfused = run(llm)
    assert fused[0] == unfused[0]
    assert fused[1] == unfused[1]
    assert torch.equal(fused[2], unfused[2])
    assert llm.engine.kv.num_free_blocks == 64


def test_layers_stay_step_by_step_where_the_fused_call_does_not_apply(tiny_llama_dir) -> None:
    # The reference attention backend: the layer's attention is not the compiled kernel.
    llm = LLM(
        str(tiny_llama_dir),
        quantization="int8",
        num_kv_blocks=32,
        block_size=8,
        attention_backend="reference",
    )
    assert llm.engine.runner.model.fused_layers == 0
    # fp32 weights: nothing to fuse.
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=8)
    assert llm.engine.runner.model.fused_layers == 0


@pytest.mark.parametrize(
    ("model", "quantization"), [("tiny_llama_dir", "int8"), (_llama_mixed_gguf, "gguf")]
)
@pytest.mark.parametrize("length", [200, 130])
def test_a_long_prompt_gives_the_step_by_step_bits(
    model: Any, quantization: str, length: int, tmp_path: Path, request
) -> None:
    """A prompt in one forward: the fused call takes the MLP 128 rows at a time (so that a
    prompt's gate/up output is never held whole; 130 leaves a last part of 2 rows), the
    step-by-step forward all rows at once; every row's logits are the same bits."""
    path = request.getfixturevalue(model) if isinstance(model, str) else model(tmp_path, request)
    llm = LLM(str(path), quantization=quantization, num_kv_blocks=64)
    model, runner = llm.engine.runner.model, llm.engine.runner
    assert model.fused_layers == len(model.layers)
    prompt = [(7 * i) % 90 + 1 for i in range(length)]
    fused = runner.logits_of(prompt)
    with step_by_step(model):
        assert torch.equal(runner.logits_of(prompt), fused)


def test_the_fused_call_keeps_its_activations_and_returns_its_own_output(
    tmp_path: Path, request
) -> None:
    """The GGUF call holds a step's activations in one workspace kept from step to step: a
    smaller step reuses it as it is, a larger one grows it. What a step returns lies outside
    it, so a later step leaves it as it was."""
    llm = LLM(str(_llama_mixed_gguf(tmp_path, request)), quantization="gguf", num_kv_blocks=64)
    model, runner = llm.engine.runner.model, llm.engine.runner
    fused = model.fused_gguf
    returned: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = fused(*args)
        returned.append((hidden, hidden.clone()))
        return hidden, residual

    model.fused_gguf = recording
    runner.logits_of([(7 * i) % 90 + 1 for i in range(200)])
    grown = fused.workspace.numel(), fused.workspace.data_ptr()
    assert grown[0] > 0
    runner.logits_of([3, 4, 5])
    assert (fused.workspace.numel(), fused.workspace.data_ptr()) == grown
    first, copy = returned[0]
    assert torch.equal(first, copy)
    workspace = fused.workspace.untyped_storage()
    for hidden, _ in returned:
        assert hidden.untyped_storage().data_ptr() != workspace.data_ptr()
    model.fused_gguf = fused
    with step_by_step(model):
        reference = runner.logits_of([3, 4, 5])
    assert torch.equal(runner.logits_of([3, 4, 5]), reference)
