"""ShareGPT files for the benches: the format vLLM's benchmarks read, its length filters,
clear errors for a broken file, skipped entries counted in a warning, and a throughput
run over real prompts."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from pagedllm.bench.datasets import sharegpt_requests
from pagedllm.entrypoints.cli import main
from pagedllm.errors import InvalidParameterError


class Words:
    """One token per word (id = its length), no special tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]


def conversation(prompt_words: int, answer_words: int) -> dict:
    return {
        "conversations": [
            {"from": "human", "value": " ".join(["ask"] * prompt_words)},
            {"from": "gpt", "value": " ".join(["answer"] * answer_words)},
        ]
    }


def write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_prompts_and_output_lengths_with_vllms_filters(tmp_path: Path, caplog) -> None:
    data = [
        conversation(10, 20),
        conversation(3, 20),  # prompt under 4 tokens
        conversation(10, 2),  # output under 4 tokens
        conversation(1025, 5),  # prompt over 1024
        conversation(1000, 1100),  # over 2048 in all
        {"conversations": [{"from": "gpt", "value": "no question"}]},  # no human turn
        {"id": "no conversations"},
        conversation(6, 7),
    ]
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        requests = sharegpt_requests(write(tmp_path, data), Words(), 10, seed=0, max_model_len=4096)
    assert sorted((r.prompt_len, r.output_len) for r in requests) == [(6, 7), (10, 20)]
    assert all(r.prompt_token_ids == (3,) * r.prompt_len for r in requests)
    assert all(r.prompt_text.startswith("ask") for r in requests)
    assert "skipped 2 entries" in caplog.text and "2 usable conversations" in caplog.text
    # The same seed gives the same order; fewer asked, fewer taken.
    again = sharegpt_requests(write(tmp_path, data), Words(), 10, seed=0, max_model_len=4096)
    assert again == requests
    assert len(sharegpt_requests(write(tmp_path, data), Words(), 1, 0, 4096)) == 1


def test_a_broken_file_is_an_error_naming_file_and_position(tmp_path: Path) -> None:
    path = tmp_path / "cut.json"
    path.write_text('[{"conversations": [{"from": "human", "value": "hi th')
    with pytest.raises(InvalidParameterError, match=r"cut.json is not valid JSON: .* line 1"):
        sharegpt_requests(str(path), Words(), 4, 0, 4096)
    with pytest.raises(InvalidParameterError, match="cannot read"):
        sharegpt_requests(str(tmp_path / "missing.json"), Words(), 4, 0, 4096)
    with pytest.raises(InvalidParameterError, match="no usable conversation"):
        sharegpt_requests(write(tmp_path, [{"x": 1}]), Words(), 4, 0, 4096)


def test_throughput_over_a_sharegpt_file(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # A word-level tokenizer saved with a copy of the tiny model: real text in, real token
    # counts out.
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    words = ["[UNK]", "ask", "answer", "the", "river"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(model)
    path = write(tmp_path, [conversation(8, 6), conversation(12, 5), conversation(5, 9)])
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            "throughput",
            "--model",
            str(model),
            "--policies",
            "paged",
            "--dataset",
            "sharegpt",
            "--dataset-path",
            path,
            "--num-prompts",
            "3",
            "--max-model-len",
            "128",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "throughput.json").read_text())
    assert result["workload"]["kind"].startswith("sharegpt (")
    assert result["workload"]["output_tokens"] == 6 + 5 + 9
    assert result["results"][0]["generated_tokens"] == 20


def test_copy_prompts_repeat_the_shipped_paragraphs() -> None:
    from pagedllm.bench.datasets import SHIPPED_TEXT, copy_requests
    from pagedllm.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()  # the default model's, from its GGUF
    paragraphs = [p.strip() for p in SHIPPED_TEXT.read_text(encoding="utf-8").split("\n\n")]
    longest = sorted((p for p in paragraphs if len(p) > 200), key=len, reverse=True)
    requests = copy_requests(tokenizer, len(longest) + 1, 16)
    assert len(requests) == len(longest) + 1
    assert all(r.output_len == 16 and r.prompt_text is None for r in requests)
    texts = [tokenizer.decode(r.prompt_token_ids) for r in requests]
    for text, paragraph in zip(texts, [*longest, longest[0]], strict=True):
        assert "Repeat this text exactly:" in text and paragraph[:80] in text
        assert text.rstrip().endswith("<|im_start|>assistant")  # ready for the answer
    assert requests[-1] == requests[0]  # cycled
