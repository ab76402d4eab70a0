"""LoRA requests through the engine against transformers + PEFT: several adapters and the
base in one batch, chunked prefill, preemption with adapters evicted from the pool and
loaded again, the prefix cache keyed by adapter, n > 1 and beams, unified paging and static
slots; and what the engine refuses."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from hf_oracle import hf_greedy, load_hf, load_hf_lora, make_lora_adapter
from pagedllm import LLM, SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.errors import InvalidParameterError
from pagedllm.lora import LoRARequest
from pagedllm.sampling_params import BeamSearchParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (targets, rank, alpha, rsLoRA) of each adapter
SHAPES = [
    (("q_proj", "v_proj"), 4, 8, False),
    (ALL, 8, 16, False),
    (("k_proj", "o_proj", "down_proj"), 2, 4, True),
]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    return [
        LoRARequest(
            f"a{i}",
            i + 1,
            str(make_lora_adapter(tiny_llama_dir, root / f"a{i}", i, r, targets, alpha, rs)),
        )
        for i, (targets, r, alpha, rs) in enumerate(SHAPES)
    ]


@pytest.fixture(scope="module")
def oracles(tiny_llama_dir: Path, adapters: list[LoRARequest]) -> dict[int, object]:
    """The HF model of each adapter id (0: the base)."""
    models = {0: load_hf(tiny_llama_dir)}
    for a in adapters:
        models[a.lora_int_id] = load_hf_lora(tiny_llama_dir, Path(a.lora_path))
    return models


def prompts_of(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def expected(oracles: dict, prompts: list[list[int]], loras: list[LoRARequest | None]):
    return [
        hf_greedy(oracles[lora.lora_int_id if lora else 0], p, GREEDY.max_tokens)
        for p, lora in zip(prompts, loras, strict=True)
    ]


def generate(llm: LLM, prompts, loras, params=GREEDY):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    return outs


def assert_pool_whole(llm: LLM) -> None:
    """Nothing runs, no adapter is pinned, and every block not free is an adapter's."""
    engine = llm.engine
    kv = engine.kv
    snap = engine.snapshot()
    assert snap.num_running == snap.num_waiting == 0 and not kv.tables
    assert all(a.pins == 0 for a in kv.adapters.resident.values())
    assert snap.usage.tokens_stored == 0
    assert snap.usage.adapter_blocks == kv.adapters.held_blocks()
    assert snap.usage.used_blocks == 0
    assert snap.usage.free_blocks + snap.usage.adapter_blocks == snap.usage.num_blocks


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=4),
        dict(block_size=8, max_num_batched_tokens=7),  # prompts in chunks
        dict(block_size=4, lora_slots="static", max_loras=3),
    ],
    ids=["unified", "chunked", "static"],
)
def test_mixed_batch_equals_peft(tiny_llama_dir, adapters, oracles, options) -> None:
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_lora_rank=8, num_kv_blocks=512, **options)
    prompts = prompts_of(0, [5, 17, 9, 12, 3, 21, 8])
    loras = [None, adapters[0], adapters[1], adapters[2], adapters[0], adapters[1], None]
    outs = generate(llm, prompts, loras)
    assert [o.outputs[0].token_ids for o in outs] == expected(oracles, prompts, loras)
    # The adapters change what the model says: the check above could not pass by accident.
    base = expected(oracles, prompts, [None] * len(prompts))
    assert sum(e != b for e, b in zip(expected(oracles, prompts, loras), base, strict=True)) >= 4
    assert_pool_whole(llm)


def test_preemption_and_eviction(tiny_llama_dir, adapters, oracles) -> None:
    """A pool too small for every request and adapter at once: requests are preempted,
    adapters evicted and loaded again, and every token still equals the oracle's."""
    llm = LLM(
        str(tiny_llama_dir),
        enable_lora=True,
        max_lora_rank=8,
        block_size=4,
        num_kv_blocks=48,
        watermark=0.0,
    )
    records: list[dict] = []
    llm.engine.record_kv(records.append)
    prompts = prompts_of(1, [9, 14, 11, 6, 13, 10, 7, 12])
    loras = [adapters[i % 3] for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = generate(llm, prompts, loras, params)
    want = [
        hf_greedy(oracles[lora.lora_int_id], p, 16) for p, lora in zip(prompts, loras, strict=True)
    ]
    assert [o.outputs[0].token_ids for o in outs] == want
    snap = llm.engine.snapshot()
    assert snap.num_preemptions > 0
    assert snap.lora_evictions > 0 and snap.lora_loads > len(adapters)
    # The KV view sees every load and eviction.
    kinds = Counter(e["k"] for r in records for e in r.get("ev", ()))
    assert (kinds["lora_load"], kinds["lora_evict"]) == (snap.lora_loads, snap.lora_evictions)
    assert_pool_whole(llm)


def test_prefix_cache_is_keyed_by_adapter(tiny_llama_dir, adapters, oracles) -> None:
    llm = LLM(
        str(tiny_llama_dir), enable_lora=True, max_lora_rank=8, block_size=4, num_kv_blocks=512
    )
    prompt = prompts_of(2, [34])[0]
    order = [adapters[0], adapters[1], adapters[0], None, None]
    cached = []
    for lora in order:  # one at a time: each finds what the ones before it left
        (out,) = generate(llm, [prompt], lora)
        assert out.outputs[0].token_ids == expected(oracles, [prompt], [lora])[0]
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 32, 0, 32]
    assert_pool_whole(llm)


def test_parallel_samples_and_beams(tiny_llama_dir, adapters, oracles) -> None:
    llm = LLM(
        str(tiny_llama_dir), enable_lora=True, max_lora_rank=8, block_size=4, num_kv_blocks=512
    )
    lora = adapters[1]
    prompt = prompts_of(3, [11])[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)
    (out,) = generate(llm, [prompt], lora, params)
    want = expected(oracles, [prompt], [lora])[0]
    assert [c.token_ids for c in out.outputs] == [want, want]

    width = 3
    beams = BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True)
    (beam,) = llm.beam_search([{"prompt_token_ids": prompt}], beams, False, lora_request=lora)
    x = torch.tensor([prompt])
    y = oracles[lora.lora_int_id].generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        num_beams=width,
        do_sample=False,
        max_new_tokens=8,
        early_stopping=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert beam.outputs[0].token_ids == y[0, len(prompt) :].tolist()
    assert_pool_whole(llm)


@pytest.mark.parametrize(
    "speculation",
    [
        dict(speculative_method="ngram", prompt_lookup_min=1, prompt_lookup_max=2),
        dict(speculative_method="draft"),  # the draft proposes from the base model's weights
    ],
    ids=["ngram", "draft"],
)
def test_speculation_checks_proposals_under_the_adapter(
    tiny_llama_dir, adapters, oracles, speculation
) -> None:
    if speculation["speculative_method"] == "draft":
        speculation = {**speculation, "speculative_model": str(tiny_llama_dir)}
    llm = LLM(
        str(tiny_llama_dir),
        enable_lora=True,
        max_lora_rank=8,
        block_size=4,
        num_kv_blocks=512,
        num_speculative_tokens=3,
        **speculation,
    )
    prompts = prompts_of(5, [7, 12, 9])
    loras = [adapters[0], None, adapters[1]]
    outs = generate(llm, prompts, loras)
    assert [o.outputs[0].token_ids for o in outs] == expected(oracles, prompts, loras)
    assert llm.engine.snapshot().spec_proposed_tokens > 0
    assert_pool_whole(llm)


def test_remove_lora_lets_running_requests_finish(tiny_llama_dir, adapters, oracles) -> None:
    llm = LLM(
        str(tiny_llama_dir), enable_lora=True, max_lora_rank=8, block_size=4, num_kv_blocks=512
    )
    engine = llm.engine
    lora = adapters[0]
    prompt = prompts_of(4, [10])[0]
    engine.add_request("r", prompt, GREEDY, lora_request=lora)
    engine.step()  # running, its adapter pinned
    assert engine.remove_lora(lora.lora_int_id)
    assert not engine.remove_lora(lora.lora_int_id)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    assert tokens == expected(oracles, [prompt], [lora])[0]
    assert lora.lora_int_id not in engine.kv.adapters.resident
    with pytest.raises(InvalidParameterError) as err:
        engine.add_request("again", prompt, GREEDY, lora_request=lora)
    assert err.value.param == "lora_int_id"
    assert_pool_whole(llm)


def test_removed_adapter_beside_a_new_one(tiny_llama_dir, adapters, oracles) -> None:
    """A request still running under a removed adapter, then one under another adapter:
    the step that changes the set of adapters runs both, each under its own."""
    llm = LLM(
        str(tiny_llama_dir), enable_lora=True, max_lora_rank=8, block_size=4, num_kv_blocks=512
    )
    engine = llm.engine
    first, second = adapters[2], adapters[1]
    prompts = prompts_of(6, [9, 11])
    engine.add_request("old", prompts[0], GREEDY, lora_request=first)
    engine.step()
    assert engine.remove_lora(first.lora_int_id)
    engine.add_request("new", prompts[1], GREEDY, lora_request=second)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None
            finals[out.request_id] = out.outputs[0].token_ids
    assert [finals["old"], finals["new"]] == expected(oracles, prompts, [first, second])
    assert_pool_whole(llm)


def test_an_adapter_that_cannot_be_read_again(tiny_llama_dir, tmp_path, oracles) -> None:
    """An adapter that left the host cache and whose folder is gone when a step must load
    it fails that step's requests with an error; its pages go back, and once the folder is
    back the next request under it runs on its real weights."""
    path = make_lora_adapter(tiny_llama_dir, tmp_path / "gone", 0, 4, ("q_proj", "v_proj"), 8)
    other = make_lora_adapter(tiny_llama_dir, tmp_path / "other", 1, 4, ("q_proj",), 8)
    gone, kept = LoRARequest("gone", 1, str(path)), LoRARequest("other", 2, str(other))
    llm = LLM(
        str(tiny_llama_dir), enable_lora=True, max_cpu_loras=1, block_size=4, num_kv_blocks=512
    )
    engine = llm.engine
    engine.check_lora(gone)
    engine.check_lora(kept)  # the host cache holds one: `gone` leaves it
    path.rename(tmp_path / "away")
    prompt = prompts_of(7, [6])[0]
    (failed,) = generate(llm, [prompt], gone)
    assert failed.error is not None and failed.outputs[0].finish_reason == "error"
    assert gone.lora_int_id not in engine.kv.adapters.resident
    assert_pool_whole(llm)
    (tmp_path / "away").rename(path)
    (out,) = generate(llm, [prompt], gone)
    assert out.error is None
    assert out.outputs[0].token_ids == hf_greedy(load_hf_lora(tiny_llama_dir, path), prompt, 8)
    assert_pool_whole(llm)


def test_refusals(tiny_llama_dir, adapters, tmp_path) -> None:
    plain = LLM(str(tiny_llama_dir), block_size=4)
    with pytest.raises(InvalidParameterError) as err:
        generate(plain, [[5, 6, 7]], adapters[0])
    assert err.value.param == "lora_request"

    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_lora_rank=4, block_size=4)
    with pytest.raises(InvalidParameterError) as err:  # rank 8 > max_lora_rank 4
        llm.engine.check_lora(adapters[1])
    assert err.value.param in ("max_lora_rank", "lora_path")
    assert "8" in str(err.value) and "4" in str(err.value)
    with pytest.raises(InvalidParameterError) as err:
        llm.engine.check_lora(LoRARequest("missing", 9, str(tmp_path / "nowhere")))
    assert err.value.param == "lora_path"
    llm.engine.check_lora(adapters[0])
    with pytest.raises(InvalidParameterError) as err:  # the same id, another adapter
        llm.engine.check_lora(LoRARequest("other", 1, adapters[2].lora_path))
    assert err.value.param == "lora_int_id"
    with pytest.raises(InvalidParameterError) as err:
        generate(llm, [[5, 6], [7, 8]], [adapters[0]])
    assert err.value.param == "lora_request"
    # Nothing half-queued stays behind.
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank"),
        (dict(enable_lora=True, max_lora_rank=513), "max_lora_rank"),
        (dict(enable_lora=True, lora_slots="fixed"), "lora_slots"),
        (dict(enable_lora=True, max_loras=0), "max_loras"),
        (dict(enable_lora=True, tensor_parallel_size=2), "enable_lora"),
        (dict(enable_lora=True, kv_reservation="reserve-max"), "enable_lora"),
    ],
)
def test_config_refusals(options, param) -> None:
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(**options)
    assert err.value.param == param
