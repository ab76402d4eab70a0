"""quantization="auto", the default: which path a model takes, decided before it loads.

A GGUF with block-quantized linear weights keeps its blocks (gguf) on the CPU in float32 on
one device: the packaged Q4_1 default model (read from its header only) and a tiny Q8_0/Q4_0
GGUF; everything else takes the exact path (none): an F32-only GGUF, a Hugging Face
directory, tensor parallelism, bfloat16, a GGUF with a type the kernels do not take. One
INFO line says which and why; the memory check estimates the path chosen; a model given
already loaded keeps its form; the four values (and only those) pass the command line of
`generate` and `serve`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gguf_convert import write_gguf
from hf_oracle import make_tiny_model
from pagedllm import LLM
from pagedllm.engine.config import EngineConfig
from pagedllm.entrypoints.cli import build_parser
from pagedllm.errors import InsufficientMemoryError, InvalidParameterError, ModelLoadError
from pagedllm.loader import load_model
from pagedllm.loader import memory_estimate as memory
from pagedllm.model.gguf_linear import GGUFLinear
from pagedllm.worker.options import RunnerOptions
from pagedllm.worker.quantization_choice import auto_quantization, resolve_quantization
from tiny_gguf import Q8_0_Q4_0, write_tiny_llama_gguf


@pytest.fixture
def quantized(tiny_quantized_gguf: Path) -> Path:
    return tiny_quantized_gguf


@pytest.fixture(scope="module")
def f32_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("auto-f32")
    return write_gguf(make_tiny_model(folder / "hf", "llama"), folder / "f32.gguf", "F32")


def _path_taken(llm: LLM) -> str:
    """The quantization the engine took, checked against its layers' kind."""
    taken = llm.engine.config.quantization
    layer = llm.engine.runner.model.layers[0].gate_up
    assert isinstance(layer, GGUFLinear) == (taken == "gguf"), taken
    return taken


def test_the_packaged_q4_1_model_keeps_its_blocks() -> None:
    try:
        path, why = auto_quantization(RunnerOptions(), None)  # the header alone
    except ModelLoadError as exc:  # the package is optional
        pytest.skip(str(exc))
    assert (path, why) == ("gguf", "the file's Q4_1, Q8_0 blocks computed on as stored")


def test_a_quantized_gguf_takes_the_gguf_path_and_says_so(quantized, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(str(quantized), num_kv_blocks=16)
    assert _path_taken(llm) == "gguf"
    said = [r.getMessage() for r in caplog.records if "quantization auto" in r.getMessage()]
    assert said == ["quantization auto: gguf, the file's Q4_0, Q8_0 blocks computed on as stored"]


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("f32", "no linear weight of the file is block-quantized"),
        ("hf", "a Hugging Face directory"),
        ("q5_1", "model.layers.0.mlp.down_proj.weight is Q5_1, which the gguf kernels do not take"),
        ("bfloat16", "dtype bfloat16"),
    ],
)
def test_what_auto_leaves_on_the_exact_path(
    case, why, quantized, f32_only, tiny_llama_dir, tmp_path, caplog
) -> None:
    model, options = str(quantized), {}
    if case == "f32":
        model = str(f32_only)
    elif case == "hf":
        model = str(tiny_llama_dir)
    elif case == "q5_1":
        model = str(tmp_path / "q5_1.gguf")
        write_tiny_llama_gguf(Path(model), {**Q8_0_Q4_0, "ffn_down": "Q5_1"}, context_length=128)
    else:
        options = {"dtype": "bfloat16"}
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(model, num_kv_blocks=16, **options)
    assert _path_taken(llm) == "none"
    dtype = options.get("dtype", "float32")
    said = [r.getMessage() for r in caplog.records if "quantization auto" in r.getMessage()]
    assert said == [f"quantization auto: none ({why}): weights dequantized to {dtype}"]


def test_tensor_parallelism_takes_the_exact_path(quantized) -> None:
    options = EngineConfig(model=str(quantized), tensor_parallel_size=2).runner_options
    assert resolve_quantization(options, str(quantized)).quantization == "none"
    assert auto_quantization(options, str(quantized)) == ("none", "tensor parallelism")


def test_a_cpu_without_the_kernels_takes_the_exact_path(quantized, monkeypatch) -> None:
    from pagedllm.worker import quantization_choice

    monkeypatch.setattr(quantization_choice, "missing_cpu_features", lambda: ["avx2", "fma"])
    options = EngineConfig(model=str(quantized)).runner_options
    why = "this CPU has no avx2, fma for the gguf kernels"
    assert auto_quantization(options, str(quantized)) == ("none", why)


def test_explicit_gguf_refuses_tensor_parallelism_and_bfloat16() -> None:
    for options in ({"tensor_parallel_size": 2}, {"dtype": "bfloat16"}, {"device": "cuda"}):
        with pytest.raises(InvalidParameterError) as err:
            EngineConfig(quantization="gguf", **options)
        assert err.value.param == "quantization"


def test_a_model_given_loaded_keeps_its_form(quantized) -> None:
    exact = load_model(str(quantized))
    kept = load_model(str(quantized), keep_quantized=True)
    assert _path_taken(LLM(loaded=exact, num_kv_blocks=16)) == "none"
    assert _path_taken(LLM(loaded=kept, num_kv_blocks=16)) == "gguf"


def test_the_memory_check_estimates_the_path_auto_takes(quantized, monkeypatch) -> None:
    """Room for the blocks and their pool, not for the dequantized weights: auto loads, none
    is refused before loading."""
    config = EngineConfig(model=str(quantized), num_kv_blocks=16, quantization="none")
    header = memory.read_model_header(str(quantized))
    from pagedllm.engine.memory_check import estimate

    blocks, dense = estimate(config, header, "gguf"), estimate(config, header, "none")
    assert blocks.peak < dense.peak
    monkeypatch.setattr(memory, "available_memory", lambda: blocks.peak)
    assert _path_taken(LLM(str(quantized), num_kv_blocks=16)) == "gguf"
    with pytest.raises(InsufficientMemoryError):
        LLM(str(quantized), num_kv_blocks=16, quantization="none")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_command_line_takes_the_four_values(command, capsys) -> None:
    tail = ["hi"] if command == "generate" else []
    parser = build_parser()
    assert parser.parse_args([command, *tail]).quantization == "auto"
    for value in ("auto", "none", "int8", "gguf"):
        args = parser.parse_args([command, "--quantization", value, *tail])
        assert args.quantization == value
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([command, "--quantization", "int4", *tail])
    assert exit_.value.code == 2
    assert "--quantization: invalid choice: 'int4'" in capsys.readouterr().err


def test_the_python_api_refuses_other_values() -> None:
    for bad in ("int4", None, "GGUF"):
        with pytest.raises(InvalidParameterError) as err:
            EngineConfig(quantization=bad)  # type: ignore[arg-type]
        assert err.value.param == "quantization"
        assert "auto, none, int8, gguf" in str(err.value)
