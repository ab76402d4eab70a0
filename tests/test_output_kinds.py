"""Output kinds against CUMULATIVE on the same run: the engine over a seeded fake runner
drawing letters a-d (so stop strings end samples often), with a letter tokenizer. A
request's DELTA outputs, joined, are its cumulative final output (text, tokens,
log-probs, finish), with the prompt in the first only; FINAL_ONLY gives exactly one
output per request, its cumulative final. For parallel samples, best_of, stop strings
kept and cut, log-probs, an aborted and a failed request."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedllm.worker.fake_runner import FakeModelRunner
from pagedllm.worker.runner import ModelSpec
from test_output_processor import Letters

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind
MAX = 14
REQUESTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": 2},
    "parallel": {"n": 3, "stop": ["ab", "dcd"], "logprobs": 1},
    "kept": {"n": 2, "stop": ["bc", "dd"], "include_stop_str_in_output": True},
    "cut": {"stop": ["cab", "dd"], "min_tokens": 2},
    "best_of": {"n": 2, "best_of": 3, "logprobs": 1},
    "aborted": {"stop": ["aa"]},
    "failed": {"n": 2, "stop": ["bd"]},
}
ABORT_AT, FAIL_AT = 4, 6  # the step "aborted" is aborted after; "failed"'s output tokens


def make_engine() -> LLMEngine:
    config = EngineConfig(block_size=4, num_kv_blocks=256, max_num_seqs=32)
    runner = FakeModelRunner(ModelSpec(4, 4096), seed=7)
    return LLMEngine(config, runner=runner, tokenizer=Letters())


def requests(kind: RequestOutputKind, names: list[str]) -> list[tuple[str, Any, SamplingParams]]:
    """(request id, prompt: text or token ids, params) of each named request."""
    return [
        (
            name,
            "dabcab" if name == "plain" else [i % 4, 1, 2, 3, 0, 1],
            SamplingParams(max_tokens=MAX, output_kind=kind, **REQUESTS[name]),
        )
        for i, name in enumerate(names)
    ]


def run(kind: RequestOutputKind, names: list[str]) -> dict[str, list[RequestOutput]]:
    """Each request's outputs, in order, from one engine run with every request of `kind`."""
    engine = make_engine()
    for request in requests(kind, names):
        engine.add_request(*request)
    check_stop = engine.output.check_stop

    def fail_one(params: SamplingParams, seq: Any) -> None:  # a stop check that raises
        failing = engine.scheduler.requests.get("failed")
        if failing is not None and seq in failing.seqs and seq.num_output_tokens == FAIL_AT:
            raise RuntimeError("injected")
        check_stop(params, seq)

    engine.output.check_stop = fail_one  # type: ignore[method-assign]
    outputs: dict[str, list[RequestOutput]] = {name: [] for name in names}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
        steps += 1
        if steps == ABORT_AT and "aborted" in names:
            engine.abort("aborted")
    assert engine.output._deltas == {}  # nothing kept of a request that ended
    assert engine.snapshot().usage.used_blocks == 0
    return outputs


NAMES = list(REQUESTS)


@pytest.fixture(scope="module")
def cumulative() -> dict[str, list[RequestOutput]]:
    return run(CUMULATIVE, NAMES)


@pytest.fixture(scope="module")
def delta() -> dict[str, list[RequestOutput]]:
    return run(DELTA, NAMES)  # the same requests: the fake runner draws the same tokens


def without_times(out: RequestOutput) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(out).items() if k != "metrics"}


def joined(deltas: list[RequestOutput]) -> list[CompletionOutput]:
    """The completions the deltas add up to, by index; a finished one never comes back."""
    whole: dict[int, CompletionOutput] = {}
    for out in deltas:
        for c in out.outputs:
            have = whole.setdefault(c.index, CompletionOutput(c.index, "", [], None, None))
            assert have.finish_reason is None, "a finished sample was sent again"
            have.text += c.text
            have.token_ids += c.token_ids
            if c.logprobs is not None:
                have.logprobs = (have.logprobs or []) + c.logprobs
            have.cumulative_logprob = c.cumulative_logprob
            have.finish_reason, have.stop_reason = c.finish_reason, c.stop_reason
    return [whole[i] for i in sorted(whole)]


def test_the_runs_cover_what_they_test(cumulative: dict[str, list[RequestOutput]]) -> None:
    final = {name: outs[-1] for name, outs in cumulative.items()}
    reasons = {c.finish_reason for out in final.values() for c in out.outputs}
    assert {"stop", "length", "error"} <= reasons
    cut = final["cut"].outputs[0]
    kept = [c for c in final["kept"].outputs if c.finish_reason == "stop"]
    assert cut.stop_reason in ("cab", "dd") and not cut.text.endswith(cut.stop_reason)
    assert kept and all(c.text.endswith(str(c.stop_reason)) for c in kept)
    assert final["failed"].error is not None and not final["aborted"].finished


@pytest.mark.parametrize("name", NAMES)
def test_deltas_add_up_to_the_cumulative_output(
    cumulative: dict[str, list[RequestOutput]], delta: dict[str, list[RequestOutput]], name: str
) -> None:
    deltas = delta[name]
    whole = cumulative[name]
    prompt = whole[0].prompt, whole[0].prompt_token_ids
    assert prompt[0] == ("dabcab" if name == "plain" else None)
    assert (deltas[0].prompt, deltas[0].prompt_token_ids) == prompt
    assert all(out.prompt is out.prompt_token_ids is None for out in deltas[1:])
    assert deltas[-1].finished == whole[-1].finished
    assert deltas[-1].error == whole[-1].error
    if name == "best_of":  # the n best are known only at the end: one output, whole
        assert len(deltas) == 1 and without_times(deltas[0]) == without_times(whole[-1])
        return
    assert len(deltas) == len(whole)  # an output at every step the request gained a token
    final = whole[-1].outputs
    if name == "aborted":  # no final output: the deltas hold what was sent so far
        assert [c.token_ids for c in joined(deltas)] == [c.token_ids for c in final]
        assert final[0].text.startswith(joined(deltas)[0].text)
        assert len(final[0].text) - len(joined(deltas)[0].text) < len("aa")
        return
    assert joined(deltas) == final


def test_a_delta_sends_only_what_is_new(
    cumulative: dict[str, list[RequestOutput]], delta: dict[str, list[RequestOutput]]
) -> None:
    whole = cumulative["parallel"]
    # Each sample that ran in a step is in its output (an ended one once more), by index.
    ran = [[c.index for c in out.outputs if c.finish_reason is None] for out in whole]
    expected = [list(range(3)), *ran[:-1]]
    assert [[c.index for c in out.outputs] for out in delta["parallel"]] == expected
    assert any(len(indexes) < 3 for indexes in expected)  # one ended before the others
    assert all(len(c.token_ids) == 1 == len(c.logprobs or []) for c in delta["parallel"][1].outputs)


def test_final_only_gives_one_output_per_request(
    cumulative: dict[str, list[RequestOutput]],
) -> None:
    finals = run(FINAL_ONLY, NAMES)
    assert finals.pop("aborted") == []
    for name, outs in finals.items():
        assert len(outs) == 1 and outs[0].finished
        assert without_times(outs[0]) == without_times(cumulative[name][-1])


@pytest.mark.parametrize(("name", "held"), [("cut", 2), ("kept", 0), ("plain", 0)])
def test_held_back_text_is_what_a_stop_string_could_cut(
    cumulative: dict[str, list[RequestOutput]],
    delta: dict[str, list[RequestOutput]],
    name: str,
    held: int,
) -> None:
    """While a sample runs, its delta text stops `held` characters short of its text
    ("cab" cut from the output: 2; stop strings kept, or none: 0)."""
    sent: dict[int, str] = {}
    for out, whole in zip(delta[name], cumulative[name], strict=True):
        for c in out.outputs:
            text = whole.outputs[c.index].text
            before = sent.get(c.index, "")
            sent[c.index] = before + c.text
            end = len(text) if c.finish_reason else max(len(before), len(text) - held)
            assert sent[c.index] == text[:end]


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_beam_search_kinds(kind: RequestOutputKind) -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=128)
    engine = LLMEngine(config, runner=FakeModelRunner(ModelSpec(4, 4096), seed=3))
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True, output_kind=kind)
    engine.add_request("b", [1, 2, 3], params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs) == 2
    assert outs[-1].prompt_token_ids == [1, 2, 3]
    assert len(outs) == (5 if kind is CUMULATIVE else 1)


def test_output_kind_is_checked() -> None:
    for make in (SamplingParams, lambda **kw: BeamSearchParams(2, 4, **kw)):
        with pytest.raises(InvalidParameterError) as err:
            make(output_kind="delta")
        assert err.value.param == "output_kind"
        assert "RequestOutputKind.DELTA" in str(err.value)


@pytest.mark.parametrize("kind", [DELTA, FINAL_ONLY])
def test_the_async_engine_streams_the_kind_asked_for(kind: RequestOutputKind) -> None:
    names = ["plain", "parallel", "kept", "best_of"]
    want = {name: [without_times(out) for out in outs] for name, outs in run(kind, names).items()}

    async def stream() -> dict[str, list[dict[str, Any]]]:
        engine = AsyncLLMEngine(make_engine())
        try:
            got: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            async for out in await engine.add_requests(requests(kind, names)):
                got[out.request_id].append(without_times(out))
            return got
        finally:
            engine.shutdown()

    assert asyncio.run(stream()) == want


@pytest.mark.parametrize("kind", list(RequestOutputKind))
@pytest.mark.parametrize(
    ("token", "extra", "reason"),
    [
        (3, {}, "length"),  # all 16 tokens used, none of them an end
        (25, {}, "stop"),  # the 16th token is EOS (min_tokens: the first 15 do not count)
        (25, {"ignore_eos": True}, "length"),
        (3, {"stop_token_ids": [3]}, "stop"),  # the 16th token is a stop token
        (3, {"stop": ["d" * 16], "include_stop_str_in_output": True}, "stop"),  # completed
    ],
)
def test_all_of_max_tokens_used_ends_length_unless_the_last_token_ends_it(
    kind: RequestOutputKind, token: int, extra: dict[str, Any], reason: str
) -> None:
    """16 of 16 tokens: "length", whatever the kind of output (a server's stream takes
    DELTA), unless the 16th token ends the output by itself."""
    config = EngineConfig(block_size=4, num_kv_blocks=64)
    runner = FakeModelRunner(ModelSpec(26, 4096), token=token)
    engine = LLMEngine(config, runner=runner, tokenizer=Letters())
    params = SamplingParams(max_tokens=16, min_tokens=16, output_kind=kind, **extra)
    engine.add_request("r", [0, 1, 2], params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    done = joined(outs) if kind is DELTA else outs[-1].outputs
    assert [c.finish_reason for c in done] == [reason]
    assert len(done[0].token_ids) == 16
