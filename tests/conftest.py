"""Shared fixtures: tiny random Llama-family models (built by `hf_oracle`), saved once
per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_oracle import make_tiny_model

# Deterministic, quick CPU runs whatever the machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")
