"""lm-evaluation-harness against `pagedllm serve`, unchanged: its `local-completions`
model on the real SmolLM2-135M (exact path, `--quantization none`) gives the same
multiple-choice accuracy and per-choice loglikelihoods (within 1e-3 on each sum) and the
same greedy generations as lm-eval's own `hf` backend on the same GGUF and items. The
tasks are written here (a YAML each over a local jsonl); nothing is downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import pagedllm
from pagedllm.loader import ModelLoadError, default_model_path

pytest.importorskip("lm_eval")

TOL = 1e-3  # on each choice's summed loglikelihood
NAME = "smollm2"
MC = [
    ("The capital of France is", ["Paris", "London", "Berlin"], 0),
    ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin"], 0),
    ("The opposite of hot is", ["warm", "cold", "red"], 1),
    ("One, two, three, four,", ["seven", "ten", "five"], 2),
    ("The sun rises in the", ["east", "west", "north"], 0),
    ("A baby cat is called a", ["puppy", "kitten", "calf"], 1),
]
GEN = [
    ("Q: What is the capital of France?\nA:", "Paris"),
    ("Q: What color is the sky on a clear day?\nA:", "Blue"),
    ("Q: How many legs does a spider have?\nA:", "8"),
]
MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: question
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def gguf() -> Path:
    try:
        return Path(default_model_path())
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def offline_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        yield


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    for name, yaml, rows in (
        ("mc", MC_YAML, [{"question": q, "choices": c, "answer": a} for q, c, a in MC]),
        ("gen", GEN_YAML, [{"question": q, "answer": a} for q, a in GEN]),
    ):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(yaml.format(data=data))
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model's tokenizer as a Hugging Face directory, for both backends."""
    from pagedllm.loader.tokenizer import load_gguf_tokenizer

    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    load_gguf_tokenizer(gguf, None).save_pretrained(folder)
    return folder


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`pagedllm serve` on the GGUF, exact path, started at once; `url()` waits for it."""

    def __init__(self, gguf: Path, log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedllm.entrypoints.cli",
                "serve",
                "--model",
                str(gguf),
                "--quantization",
                "none",
                "--served-model-name",
                NAME,
                "--port",
                str(self.port),
                "--max-model-len",
                "1024",
                "--no-kv-view",
                "--log-level",
                "warning",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(Path(pagedllm.__file__).parents[1])},
        )

    def url(self) -> str:
        """The completions URL, once the server answers."""
        base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300  # a hang guard for the start, not a timing
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health").status_code == 200:
                    return base + "/v1/completions"
            except httpx.TransportError:
                time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def serve(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = Served(gguf, tmp_path_factory.mktemp("serve") / "serve.log")
    yield served
    served.close()


def evaluate(model: Any, model_args: dict[str, Any] | None, tasks: Path) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["tiny_mc", "tiny_gen"],
        task_manager=manager,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def per_item(results: dict[str, Any], task: str) -> list[Any]:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [s["filtered_resps"] for s in samples]


def test_local_completions_equal_the_hf_backend(
    serve: Served, gguf: Path, tasks: Path, tokenizer_dir: Path, offline_env: None
) -> None:
    from lm_eval.models.huggingface import HFLM

    # Loaded while the server starts.
    hf = HFLM(
        pretrained=str(gguf.parent),
        gguf_file=gguf.name,
        tokenizer=str(tokenizer_dir),
        dtype="float32",
        device="cpu",
        batch_size=1,
    )
    own = evaluate(hf, None, tasks)
    served = evaluate(
        "local-completions",
        {
            "model": NAME,
            "base_url": serve.url(),
            "tokenizer": str(tokenizer_dir),
            "tokenizer_backend": "huggingface",
            "batch_size": 4,
            "max_retries": 1,
        },
        tasks,
    )
    acc = served["results"]["tiny_mc"]["acc,none"]
    assert acc == own["results"]["tiny_mc"]["acc,none"]
    mine, theirs = per_item(served, "tiny_mc"), per_item(own, "tiny_mc")
    assert len(mine) == len(MC)
    for item, expected in zip(mine, theirs, strict=True):
        assert len(item) == len(expected) == 3
        for (ll, greedy), (want, want_greedy) in zip(item, expected, strict=True):
            assert abs(ll - want) < TOL, (ll, want)
            assert greedy == want_greedy
    assert per_item(served, "tiny_gen") == per_item(own, "tiny_gen")
    gen_match = served["results"]["tiny_gen"]["exact_match,none"]
    assert gen_match == own["results"]["tiny_gen"]["exact_match,none"]
