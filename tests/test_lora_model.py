"""LoRA adapters in the real runner: a step mixing rows of several adapters and of the
base gives, row for row, the logits of transformers + PEFT (the oracle) for each row's
adapter, on an HF-directory base and on the same model as a GGUF; the adapters travel
through pages of the KV pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gguf_convert import write_gguf
from hf_oracle import load_hf, load_hf_lora, make_lora_adapter
from pagedllm.core.scheduler_output import AdapterLoad, ScheduledSeq, SchedulerOutput
from pagedllm.errors import InvalidParameterError
from pagedllm.loader import load_model
from pagedllm.lora.peft_config import TARGETS
from pagedllm.worker.model_runner import TorchModelRunner
from pagedllm.worker.options import RunnerOptions

BLOCK = 16
ATOL = 1e-4


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Adapter id -> PEFT directory: q/v rank 4; all seven targets rank 8; rsLoRA rank 2
    on k/o/down; a regex target on one layer only."""
    root = tmp_path_factory.mktemp("adapters")
    made = {
        1: make_lora_adapter(tiny_llama_dir, root / "qv", seed=1, r=4),
        2: make_lora_adapter(tiny_llama_dir, root / "all", seed=2, r=8, targets=TARGETS),
        3: make_lora_adapter(
            tiny_llama_dir,
            root / "rs",
            seed=3,
            r=2,
            targets=("k_proj", "o_proj", "down_proj"),
            alpha=6,
            rslora=True,
        ),
    }
    made[4] = _peft_adapter(
        tiny_llama_dir, root / "regex", r=3, target_modules=r".*\.layers\.1\.mlp\.(up|gate)_proj"
    )
    made[5] = _peft_adapter(
        tiny_llama_dir, root / "layer0", r=2, target_modules=["v_proj"], layers_to_transform=[0]
    )
    return made


def _peft_adapter(base: Path, path: Path, **config) -> Path:
    """A random PEFT adapter of `config` (LoraConfig's fields) as make_lora_adapter makes
    them, for the target forms it does not write (a regex, some layers only)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    lora = LoraConfig(lora_alpha=8, init_lora_weights=False, lora_dropout=0.0, **config)
    get_peft_model(load_hf(base), lora).save_pretrained(path)
    return path


def _oracle_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _runner(path: str, quantization: str = "none", **options) -> TorchModelRunner:
    loaded = load_model(path, keep_quantized=quantization == "gguf")
    options = RunnerOptions(enable_lora=True, quantization=quantization, **options)
    runner = TorchModelRunner(loaded, options)
    runner.init_kv_cache(num_blocks=64, block_size=BLOCK)
    return runner


def _steps(runner: TorchModelRunner, adapters: dict[int, Path], prompts, lora_ids, between=None):
    """A prefill step and a decode step of `prompts` (sequence i under lora_ids[i]), the
    adapters loaded into pages past the sequences' blocks; the logits of each step.
    `between()` runs between the two."""
    blocks, next_block = [], 0
    for p in prompts:
        n = -(-(len(p) + 1) // BLOCK)
        blocks.append(tuple(range(next_block, next_block + n)))
        next_block += n
    used = sorted({i for i in lora_ids if i})
    loads, pages = [], {}
    for i in used:
        n = runner.adapter_pages(str(adapters[i]), BLOCK)
        pages[i] = tuple(range(next_block, next_block + n))
        next_block += n
        loads.append(AdapterLoad(i, str(adapters[i]), pages[i]))
    seqs = tuple(
        ScheduledSeq(f"r{k}", k, tuple(p), 0, (blocks[k],), True, lora_id=lora_ids[k])
        for k, p in enumerate(prompts)
    )
    step = SchedulerOutput(seqs, {}, (), (), lora_loads=tuple(loads), lora_pages=pages)
    prefill, _ = runner.forward(step, runner.input_batch.step_tables(step))
    if between is not None:
        between()
    nxt = [(7 * k + 3) % 128 for k in range(len(prompts))]
    seqs = tuple(
        ScheduledSeq(
            f"r{k}", k, (nxt[k],), len(p), ((),), True, replaces_tables=False, lora_id=lora_ids[k]
        )
        for k, p in enumerate(prompts)
    )
    step = SchedulerOutput(seqs, {}, (), (), lora_pages=pages)
    decode, _ = runner.forward(step, runner.input_batch.step_tables(step))
    return prefill, decode, nxt


PROMPTS = [
    [5, 9, 17, 33, 2, 8, 71],
    [11, 12, 13, 14, 15],
    list(range(40, 60)),
    [(3 * i + 1) % 128 for i in range(70)],  # more rows than a tile: adapter 1 splits
    [100, 90, 80, 70],
    [1, 2, 3],
    [64, 32, 16, 8, 4, 2],
    [9, 9, 9, 9, 9, 9, 9, 9, 9],
]
LORA_IDS = [0, 1, 2, 1, 3, 0, 4, 5]


def _check(prefill, decode, nxt, base: Path, adapters: dict[int, Path]) -> None:
    oracles = {0: load_hf(base)}
    for k, (prompt, lora_id) in enumerate(zip(PROMPTS, LORA_IDS, strict=True)):
        if lora_id not in oracles:
            oracles[lora_id] = load_hf_lora(base, adapters[lora_id])
        want = _oracle_logits(oracles[lora_id], [*prompt, nxt[k]])
        torch.testing.assert_close(prefill[k], want[-2], atol=ATOL, rtol=0)
        torch.testing.assert_close(decode[k], want[-1], atol=ATOL, rtol=0)
    # the adapters change the logits: a row under one is not the base's
    base_want = _oracle_logits(oracles[0], PROMPTS[1])[-1]
    assert (prefill[1] - base_want).abs().max() > 1e-2


def test_mixed_batch_matches_peft_row_for_row(tiny_llama_dir: Path, adapters) -> None:
    """Also after the engine removed adapter 1 (drop_adapter): its requests in flight
    finish under it, read from its pages."""
    runner = _runner(str(tiny_llama_dir), attention_backend="reference")
    drop = lambda: runner.drop_adapter(1)  # noqa: E731
    prefill, decode, nxt = _steps(runner, adapters, PROMPTS, LORA_IDS, drop)
    _check(prefill, decode, nxt, tiny_llama_dir, adapters)


def test_host_cache_keeps_max_cpu_loras(tiny_llama_dir: Path, adapters) -> None:
    runner = _runner(str(tiny_llama_dir), max_cpu_loras=2)
    lora = runner.lora
    assert lora is not None
    for i in (1, 2, 1, 3, 1, 2):
        runner.adapter_pages(str(adapters[i]), BLOCK)
    assert lora.num_disk_loads == 4  # 1, 2, 3 and 2 again (1 stayed the most recent)


def test_gguf_base_matches_peft_on_the_hf_model(
    tiny_llama_dir: Path, adapters, tmp_path: Path
) -> None:
    """llama.cpp permutes the Q/K rows of a GGUF; the loader undoes it, so adapters trained
    on the HF checkpoint apply as they are. With the file's blocks kept, the compiled
    all-layers call steps aside for the adapters."""
    path = write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")
    for quantization in ("none", "gguf"):
        runner = _runner(str(path), quantization=quantization)
        prefill, decode, nxt = _steps(runner, adapters, PROMPTS, LORA_IDS)
        _check(prefill, decode, nxt, tiny_llama_dir, adapters)


def test_a_step_of_base_rows_only_runs_the_base(tiny_llama_dir: Path, adapters) -> None:
    runner = _runner(str(tiny_llama_dir), attention_backend="reference")
    prefill, _, _ = _steps(runner, adapters, PROMPTS[:1], [0])
    want = _oracle_logits(load_hf(tiny_llama_dir), PROMPTS[0])[-1]
    torch.testing.assert_close(prefill[0], want, atol=ATOL, rtol=0)


def test_lora_needs_enable_lora_and_one_layer_group(tiny_llama_dir: Path, adapters) -> None:
    runner = TorchModelRunner(load_model(str(tiny_llama_dir)), RunnerOptions(quantization="none"))
    with pytest.raises(InvalidParameterError) as info:
        runner.adapter_pages(str(adapters[1]), BLOCK)
    assert info.value.param == "enable_lora"
    options = RunnerOptions(enable_lora=True, quantization="none")
    runner = TorchModelRunner(load_model(str(tiny_llama_dir)), options)
    with pytest.raises(InvalidParameterError) as info:
        runner.init_kv_cache(8, BLOCK, layer_groups=((0,), (1,)))
    assert info.value.param == "enable_lora"


def test_page_counts(tiny_llama_dir: Path, adapters) -> None:
    """hidden 64, intermediate 128, 2 KV heads of 16: a page of 16 tokens holds 1024
    floats a layer; q/v rank 4 takes 4 * (64 + 64 + 64 + 32) floats (1 page); all seven
    targets at rank 16: 16 * 1024 floats (16 pages)."""
    runner = _runner(str(tiny_llama_dir))
    assert runner.adapter_pages(str(adapters[1]), BLOCK) == 1
    assert runner.max_adapter_pages(BLOCK) == 16
    assert runner.max_adapter_pages(8) == 32
    assert runner.adapter_pages(str(adapters[2]), 8) == 16  # rank 8 on all seven, 512 a page


def test_proposals_are_checked_under_the_adapter(tiny_llama_dir: Path, adapters) -> None:
    """Speculation (n-gram proposals): a row's k proposed tokens get k+1 logits rows, all
    computed under the row's adapter."""
    runner = _runner(str(tiny_llama_dir), attention_backend="reference")
    pages = tuple(range(4, 4 + runner.adapter_pages(str(adapters[2]), BLOCK)))
    load = AdapterLoad(2, str(adapters[2]), pages)
    ids, drafts = (5, 6, 7, 8, 9, 10), (11, 12)
    seqs = (
        ScheduledSeq("a", 0, (*ids, *drafts), 0, ((0,),), True, drafts, lora_id=2),
        ScheduledSeq("b", 1, ids, 0, ((1,),), True),
    )
    step = SchedulerOutput(seqs, {}, (), (), lora_loads=(load,), lora_pages={2: pages})
    logits, _ = runner.forward(step, runner.input_batch.step_tables(step))
    want = _oracle_logits(load_hf_lora(tiny_llama_dir, adapters[2]), [*ids, *drafts])
    torch.testing.assert_close(logits[:3], want[-3:], atol=ATOL, rtol=0)
    base = _oracle_logits(load_hf(tiny_llama_dir), list(ids))
    torch.testing.assert_close(logits[3], base[-1], atol=ATOL, rtol=0)
