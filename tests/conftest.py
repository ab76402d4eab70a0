"""Shared fixtures: tiny random Llama-family models (built by `hf_oracle`), saved once
per session, and a live server over a chat model (built by `live_server`); the int8 GEMM
choice in a file of the session's own."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hf_oracle import make_tiny_model
from live_server import OPTIONS, LiveServer, build_chat_model, start_server
from pagedllm.entrypoints.llm import LLM
from tiny_gguf import Q8_0_Q4_0, write_tiny_llama_gguf

# Deterministic, quick CPU runs whatever the machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session", autouse=True)
def own_int8_choice(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The int8 GEMM choice is measured in this session, into its own file: one cached
    under ~/.cache/pagedllm by an earlier run (another build, another load on the
    machine) cannot decide which kernels the tests run."""
    folder = tmp_path_factory.mktemp("int8-choice")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("pagedllm.model.linear.cache_dir", lambda: folder)
        yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_quantized_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama GGUF of Q8_0 and Q4_0 matrices (tiny_gguf.py), built once."""
    path = tmp_path_factory.mktemp("tiny-gguf") / "q8_0_q4_0.gguf"
    write_tiny_llama_gguf(path, Q8_0_Q4_0, context_length=128)
    return path


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory):
    """A function: the tiny random model of a family (hf_oracle.FAMILIES), built once."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template."""
    return build_chat_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(chat_model_dir: Path) -> Iterator[LiveServer]:
    """A real server (uvicorn on a free loopback port) over the chat model, per module."""
    live = start_server(chat_model_dir)
    yield live
    live.close()


@pytest.fixture(scope="module")
def offline(chat_model_dir: Path) -> LLM:
    """The offline API over the same model, for comparing the server's outputs."""
    return LLM(str(chat_model_dir), **OPTIONS)
