"""The grammar compiler's bounds, on SmolLM2's real tokenizer: a compile past its bound is
killed with its worker process, which frees its place at once; a caller with no worker
free is told the real wait; a refused grammar stays refused whatever its descriptions say;
the compiled grammars kept are bounded in bytes; a worker that dies fails only the grammar
it was compiling."""

from __future__ import annotations

import os
import random
import signal
import string
import threading
import time
from typing import Any

import pytest
from transformers import AutoTokenizer

from inspect_internals import grammar_cache_bytes, idle_worker_pids, num_compiles
from pagedllm import StructuredOutputs
from pagedllm.errors import EngineOverloadedError, InvalidParameterError
from pagedllm.structured.grammar import GrammarCompiler


@pytest.fixture(scope="module")
def tokenizer(chat_model_dir) -> Any:
    return AutoTokenizer.from_pretrained(chat_model_dir)


def compiler_for(tokenizer: Any, **options: Any) -> GrammarCompiler:
    """A compiler of its own, its worker started (a warm-up compile)."""
    options.setdefault("cache_bytes", 64 << 20)
    compiler = GrammarCompiler(tokenizer, 49152, {2}, **options)
    compiler.compile(StructuredOutputs(regex="[a-z]"))
    return compiler


def words(n: int, seed: int) -> list[str]:
    """`n` distinct random words: a choice among 100,000 takes some 15 s to compile on
    this vocabulary (a 50,000-word choice took 7-9 s; about 5x the longest bound used
    here, so a faster machine still cannot finish one in time), one among 300 a fraction
    of a second."""
    rng = random.Random(seed)
    return list({"".join(rng.choices(string.ascii_lowercase, k=12)) for _ in range(n)})


def slow(seed: int) -> StructuredOutputs:
    return StructuredOutputs(choice=words(100_000, seed))


def test_a_compile_past_its_bound_is_killed_and_frees_its_place(tokenizer: Any) -> None:
    compiler = compiler_for(tokenizer, timeout_s=0.5, max_concurrent=1)
    (pid,) = idle_worker_pids(compiler.pool)
    start = time.monotonic()
    with pytest.raises(InvalidParameterError) as e:
        compiler.compile(slow(1))
    assert e.value.param == "structured_outputs.choice"
    assert "did not compile within 0.5 s" in str(e.value)
    assert time.monotonic() - start < 30  # the bound, the kill and a fresh worker
    # Its worker is gone, and a fresh one compiles the next grammar at once: nothing
    # runs on holding the only place (the unfixed compiler refused it as busy).
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert idle_worker_pids(compiler.pool) != [pid]
    assert compiler.compile(StructuredOutputs(regex="[xyz]{4}")) is not None
    assert num_compiles(compiler) == 3
    compiler.close()


def test_a_caller_with_no_worker_free_is_told_the_real_wait(tokenizer: Any) -> None:
    """One worker, a 3 s bound: A runs from 0 s (killed at 3 s); B (from 1.0 s) takes
    the worker at 3 s and is killed at about 6 s; C (from 1.2 s) waits its 3 s and is
    told to retry when B's bound comes, about 1.8 s later, not after a fixed 1 s."""
    compiler = compiler_for(tokenizer, timeout_s=3.0, max_concurrent=1)
    specs = {name: slow(seed) for seed, name in enumerate("ABC")}
    outcomes: dict[str, Any] = {}

    def run(name: str) -> None:
        try:
            compiler.compile(specs[name])
            outcomes[name] = "compiled"
        except InvalidParameterError:
            outcomes[name] = "refused"
        except EngineOverloadedError as exc:
            outcomes[name] = exc

    threads = {name: threading.Thread(target=run, args=(name,)) for name in "ABC"}
    for name, delay in (("A", 0.0), ("B", 1.0), ("C", 0.2)):
        time.sleep(delay)
        threads[name].start()
    for thread in threads.values():
        thread.join()
    assert outcomes["A"] == outcomes["B"] == "refused", outcomes
    busy = outcomes["C"]
    assert isinstance(busy, EngineOverloadedError), outcomes
    assert busy.retry_after_s is not None and 1.2 < busy.retry_after_s <= 3.0, busy.retry_after_s
    assert num_compiles(compiler) == 1 + 2  # C never compiled
    compiler.close()


def test_a_changed_description_does_not_get_past_a_refusal(tokenizer: Any) -> None:
    compiler = compiler_for(tokenizer, timeout_s=0.5)
    enum = words(100_000, 7)

    def schema(note: str) -> dict[str, Any]:
        return {
            "type": "object",
            "description": note,
            "properties": {"pick": {"enum": enum, "title": note, "examples": [enum[0]]}},
            "required": ["pick"],
            "$comment": note,
        }

    for note in ("first", "second", "third"):
        with pytest.raises(InvalidParameterError) as e:
            compiler.compile(StructuredOutputs(json=schema(note)))
        assert "did not compile within 0.5 s" in str(e.value)
    assert num_compiles(compiler) == 1 + 1  # the warm-up, then one compile: the others remembered
    compiler.close()


def test_the_kept_grammars_are_bounded_in_bytes(tokenizer: Any) -> None:
    bound = 2 << 20
    compiler = compiler_for(tokenizer, cache_bytes=bound)
    choices = [StructuredOutputs(choice=words(300, seed)) for seed in range(8)]
    for spec in choices:
        assert compiler.compile(spec) is not None
        assert 0 < grammar_cache_bytes(compiler) <= bound
    # The latest are kept (compiling again starts nothing), the oldest were dropped.
    before = num_compiles(compiler)
    compiler.compile(choices[-1])
    assert num_compiles(compiler) == before
    compiler.compile(choices[0])
    assert num_compiles(compiler) == before + 1
    assert grammar_cache_bytes(compiler) <= bound
    compiler.close()
    # A grammar larger than the whole bound is used, never kept.
    tiny = compiler_for(tokenizer, cache_bytes=1000)
    kept = grammar_cache_bytes(tiny)
    for _ in range(2):
        assert tiny.compile(choices[0]) is not None
    assert grammar_cache_bytes(tiny) == kept and num_compiles(tiny) == 1 + 2
    tiny.close()


def test_a_worker_that_dies_fails_only_its_grammar(tokenizer: Any) -> None:
    compiler = compiler_for(tokenizer, timeout_s=60.0, max_concurrent=1)
    (pid,) = idle_worker_pids(compiler.pool)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            compiler.compile(slow(3))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    while idle_worker_pids(compiler.pool):  # until the compile has taken the worker
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    thread.join()
    (error,) = errors
    assert isinstance(error, InvalidParameterError) and "compiler failed" in str(error)
    assert compiler.compile(StructuredOutputs(regex="[pq]{3}")) is not None
    compiler.close()
