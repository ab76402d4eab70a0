"""Structured output in the engine: a tiny random model emits garbage, so every output
that follows a grammar (JSON schemas, regexes, choices, EBNF) parses and validates only
because the grammar held it. Constrained requests batch with ordinary ones without
changing them, fork with n > 1, survive preemption, and fail alone."""

from __future__ import annotations

import json
import pickle
import re
from typing import Any

import jsonschema
import pytest
import torch

from inspect_internals import num_compiles
from live_server import OPTIONS
from pagedllm import LLM, SamplingParams, StructuredOutputs
from pagedllm.errors import InvalidParameterError
from pagedllm.structured.grammar import GrammarCompiler

# Every string, array and number bounded: a random model would otherwise ramble to
# max_tokens inside a string.
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "admin": {"type": "boolean"},
        },
        "required": ["user", "admin"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "bounds": {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 10, "maximum": 20},
            "k": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
        },
        "required": ["n", "k"],
        "additionalProperties": False,
    },
}
PROMPT = "Answer in JSON:"


def structured(max_tokens: int = 80, seed: int = 1, n: int = 1, **kind: object) -> SamplingParams:
    return SamplingParams(
        n=n,
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputs(**kind),  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def llm(chat_model_dir) -> LLM:
    return LLM(str(chat_model_dir), **OPTIONS)


def test_structured_outputs_is_validated() -> None:
    for kind, param in [
        ({}, "structured_outputs"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": "[1]"}, "structured_outputs.json"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 3]}, "structured_outputs.choice"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
    ]:
        with pytest.raises(InvalidParameterError) as e:
            StructuredOutputs(**kind)  # type: ignore[arg-type]
        assert e.value.param == param, kind
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(structured_outputs={"jsn": {}})  # type: ignore[arg-type]
    assert e.value.param == "structured_outputs"
    as_dict = SamplingParams(structured_outputs={"regex": "a+"})  # type: ignore[arg-type]
    assert as_dict.structured_outputs == StructuredOutputs(regex="a+")
    # One schema, one key, however it was spaced; the order of properties is kept (it is
    # the output's order).
    a = StructuredOutputs(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert (
        a.key()
        == StructuredOutputs(json='{"type":"object",\n "properties": {"b": {}, "a": {}}}').key()
    )
    assert (
        a.key()
        != StructuredOutputs(json={"type": "object", "properties": {"a": {}, "b": {}}}).key()
    )
    # Annotations are not the grammar: a changed description, title or example is the same
    # key; a property that happens to be named "description" is not an annotation.
    noted = {
        "type": "object",
        "title": "T",
        "description": "d",
        "properties": {"b": {"description": "x"}, "a": {"examples": [1]}},
        "$comment": "c",
    }
    assert StructuredOutputs(json=noted).key() == a.key()
    named = {"type": "object", "properties": {"description": {}, "a": {}}}
    assert StructuredOutputs(json=named).key() != a.key()
    # A value nested far deeper than JSON allows is refused by name, not with a
    # RecursionError (nor shown whole in the message).
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    for kind, param in [
        ({"choice": deep}, "structured_outputs.choice"),
        ({"json": deep}, "structured_outputs.json"),
    ]:
        with pytest.raises(InvalidParameterError) as e:
            StructuredOutputs(**kind)  # type: ignore[arg-type]
        assert e.value.param == param and len(str(e.value)) < 300


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_output_validates_against_its_schema(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    outs = llm.generate([PROMPT] * 3, structured(seed=None, json=schema), use_tqdm=False)
    for out in outs:
        (c,) = out.outputs
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), schema)


def test_json_object_regex_choice_and_ebnf(llm: LLM) -> None:
    eos = llm.get_tokenizer().eos_token_id
    # `}` favoured: a random model closes the object at once instead of rambling on.
    close = llm.get_tokenizer().convert_tokens_to_ids("}")
    params = SamplingParams(
        temperature=0,
        max_tokens=40,
        logit_bias={close: 30.0},
        structured_outputs=StructuredOutputs(json_object=True),
    )
    (c,) = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    assert isinstance(json.loads(c.text), dict) and c.finish_reason == "stop"
    assert c.token_ids[-1] == eos  # the grammar ended with the model's EOS

    regex = r"[0-9]{3}-[a-z]{2,4}"
    for c in llm.generate([PROMPT] * 3, structured(regex=regex, seed=None), use_tqdm=False):
        assert re.fullmatch(regex, c.outputs[0].text), c.outputs[0].text
    choices = ["yes", "no", 'say "maybe"']
    texts = {
        c.outputs[0].text
        for c in llm.generate([PROMPT] * 6, structured(choice=choices, seed=None), use_tqdm=False)
    }
    assert texts <= set(choices)
    grammar = 'root ::= "(" num ("," num)? ")"\nnum ::= [0-9]'
    (c,) = llm.generate([PROMPT], structured(grammar=grammar), use_tqdm=False)[0].outputs
    assert re.fullmatch(r"\([0-9](,[0-9])?\)", c.text), c.text


def test_ignore_eos_still_ends_where_the_grammar_ends(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, min_tokens=10,
        structured_outputs=StructuredOutputs(choice=["yes", "no"]),
    )  # fmt: skip
    (c,) = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    assert c.text in ("yes", "no") and c.finish_reason == "stop"


def test_batched_with_plain_requests_leaves_them_unchanged(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Hello there", "The capital of France", "1, 2, 3"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed = llm.generate(
        [prompts[0], PROMPT, prompts[1], PROMPT, prompts[2]],
        [plain, structured(json=SCHEMAS["enum"]), plain, structured(regex="[ab]{5}"), plain],
        use_tqdm=False,
    )
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS["enum"])
    assert re.fullmatch("[ab]{5}", mixed[3].outputs[0].text)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert len(llm.engine.grammars) == 0  # every matcher dropped with its sequence


def test_parallel_samples_each_follow_the_grammar(llm: LLM) -> None:
    schema = SCHEMAS["nested"]
    (out,) = llm.generate([PROMPT], structured(n=4, json=schema, seed=3), use_tqdm=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in out.outputs}) > 1  # forked matchers, not one shared


def test_a_preempted_request_keeps_its_place_in_the_grammar(chat_model_dir) -> None:
    # A pool too small for all four: requests are preempted and recomputed mid-output.
    small = LLM(str(chat_model_dir), num_kv_blocks=24, block_size=4, watermark=0)
    schema = SCHEMAS["nested"]
    outs = small.generate([PROMPT * 3] * 4, structured(json=schema, seed=None), use_tqdm=False)
    assert sum(o.num_preemptions for o in outs) > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    assert small.engine.kv.num_free_blocks == small.engine.kv.num_blocks


def test_bad_grammars_are_refused_at_add_request(llm: LLM) -> None:
    engine = llm.engine
    for kind, param in [
        ({"json": {"type": "frobnicate"}}, "structured_outputs.json"),
        ({"regex": "(unclosed"}, "structured_outputs.regex"),
        ({"grammar": "root ::= "}, "structured_outputs.grammar"),
        # no finite sentence: it could never end an output
        ({"grammar": "root ::= a\na ::= root"}, "structured_outputs.grammar"),
        (
            {"json": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
            "structured_outputs.json",
        ),
    ]:
        with pytest.raises(InvalidParameterError) as e:
            engine.add_request("bad", [1, 2, 3], structured(**kind))
        assert e.value.param == param
        assert ".cc:" not in str(e.value)  # the library's source location is not for users
    assert not engine.has_unfinished_requests()


def test_a_slow_compile_is_refused_within_the_bound(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    compiler = GrammarCompiler(
        tokenizer, llm.engine.vocab_size, {2}, cache_bytes=1 << 20, timeout_s=1e-4
    )
    spec = StructuredOutputs(json=SCHEMAS["nested"])
    with pytest.raises(InvalidParameterError) as e:
        compiler.compile(spec)
    assert e.value.param == "structured_outputs.json" and "did not compile" in str(e.value)
    with pytest.raises(InvalidParameterError):  # remembered: no second compile starts
        compiler.compile(spec)
    assert num_compiles(compiler) == 1


def test_compiled_once_then_cached(llm: LLM) -> None:
    spec = StructuredOutputs(regex="[xyz]{4}")
    llm.engine.compile_grammar(spec)
    compiler = llm.engine.grammars.compiler
    before = num_compiles(compiler)
    outs = llm.generate([PROMPT] * 2, SamplingParams(max_tokens=8, structured_outputs=spec))
    assert num_compiles(compiler) == before
    assert all(re.fullmatch("[xyz]{4}", o.outputs[0].text) for o in outs)


def test_the_runner_gets_plain_rows_and_one_reused_bitmask(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's rows hold no matcher (they pickle), only their row of the step's int32
    bitmask, which the engine fills and reuses step after step; each drawn token is one
    its row allowed. Two samples of a choice (n 2) beside an unconstrained request."""
    engine = llm.engine
    execute = engine.runner.execute
    seen: list[tuple[list[int], Any]] = []

    def recording(step: Any, rows: Any, grammar_bitmask: Any = None, prompt_rows: Any = ()) -> Any:
        rows = pickle.loads(pickle.dumps(list(rows)))
        sampled = execute(step, rows, grammar_bitmask, prompt_rows)
        grammar_rows = [r.grammar_row for r in rows]
        for i, m in enumerate(grammar_rows):
            if m >= 0:
                t = sampled.token_ids[i]
                assert (int(grammar_bitmask[m, t // 32]) >> (t % 32)) & 1
        seen.append((grammar_rows, grammar_bitmask))
        return sampled

    monkeypatch.setattr(engine.runner, "execute", recording)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    choices = ["yes", "no", "maybe"]
    outs = llm.generate(
        [PROMPT, "Hello there"], [structured(n=2, choice=choices), plain], use_tqdm=False
    )
    assert all(c.text in choices for c in outs[0].outputs) and len(outs[0].outputs) == 2
    with_grammar = [(rows, mask) for rows, mask in seen if max(rows, default=-1) >= 0]
    assert with_grammar and all(
        sorted(m for m in rows if m >= 0) == list(range(sum(m >= 0 for m in rows)))
        for rows, _ in with_grammar
    )
    assert any(sum(m >= 0 for m in rows) == 2 for rows, _ in with_grammar)  # both samples
    masks = {id(mask) for _, mask in with_grammar}
    assert len(masks) == 1  # one tensor, refilled each step
    mask = with_grammar[0][1]
    assert mask.dtype == torch.int32 and mask.shape[1] == -(-engine.vocab_size // 32)
    assert all(mask is None for rows, mask in seen if max(rows, default=-1) < 0)


def test_a_grammar_failure_fails_only_its_request(llm: LLM) -> None:
    engine = llm.engine
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = llm.generate(["Hello there"], plain, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("victim", PROMPT, structured(json=SCHEMAS["enum"]))
    engine.add_request("survivor", "Hello there", plain)
    engine.add_request("other", PROMPT, structured(regex="[ab]{5}"))
    engine.add_request("broken", PROMPT, structured(choice=["x", "y"]))

    def grammar_of(request_id: str) -> Any:
        return engine.grammars.get(engine.scheduler.requests[request_id].seqs[0].seq_id)

    # One matcher rejects every token, one raises filling its row of the step's bitmask.
    grammar_of("victim").accept = lambda token_id: False

    def broken(bitmask: Any, row: int) -> None:
        raise RuntimeError("matcher state lost")

    grammar_of("broken").fill_bitmask = broken
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["victim"].error and "GrammarError" in finals["victim"].error
    assert finals["broken"].error and "matcher state lost" in finals["broken"].error
    assert finals["survivor"].error is None
    assert finals["survivor"].outputs[0].token_ids == expected
    assert re.fullmatch("[ab]{5}", finals["other"].outputs[0].text)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert len(engine.grammars) == 0
