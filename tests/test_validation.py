"""check_int, the one integer check: the field and the range in every refusal, bools
refused, integer scalars of other kinds taken as ints, 64 bits at most; no integer check
written by hand outside validation.py (read with `ast`), and what used to write its own
(a model's windows, a LoRA request's id, an adapter's rank and layers) refuses a bool."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from hf_oracle import TINY
from pagedllm.errors import InvalidParameterError
from pagedllm.loader import ModelLoadError
from pagedllm.loader.hf_loader import hf_config
from pagedllm.lora import LoRARequest
from pagedllm.lora.peft_config import read_peft_config
from pagedllm.model.config import ModelConfig
from pagedllm.validation import check_int

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedllm"


@pytest.mark.parametrize(
    ("value", "bounds", "message"),
    [
        (0, {"min": 1}, "n must be an integer >= 1, got 0"),
        (True, {"min": 0}, "n must be an integer >= 0, got True"),
        (1.0, {}, "n must be an integer, got 1.0"),
        ("3", {"max": 5}, "n must be an integer <= 5, got '3'"),
        (9, {"min": 1, "max": 8}, "n must be an integer in [1, 8], got 9"),
        (2**63, {"min": 1}, "n must be an integer >= 1 (integers must fit in 64 bits), got "),
        (list(range(100)), {}, "n must be an integer, got [0, 1, 2, 3, 4, 5,"),
    ],
)
def test_a_refusal_names_the_field_and_the_range(
    value: object, bounds: dict[str, int], message: str
) -> None:
    with pytest.raises(InvalidParameterError) as info:
        check_int(value, "n", **bounds)
    assert info.value.param == "n" and str(info.value).startswith(message)
    assert len(str(info.value)) < 150


def test_an_integer_in_range_comes_back_as_an_int() -> None:
    assert check_int(np.int64(7), "n", min=0, max=7) == 7
    assert type(check_int(np.int64(7), "n")) is int
    assert check_int(-(2**63), "n") == -(2**63)
    with pytest.raises(InvalidParameterError):
        check_int(np.bool_(True), "n")


def test_the_words_can_be_the_callers() -> None:
    with pytest.raises(InvalidParameterError) as info:
        check_int(500, "prompt", min=0, max=127, subject="prompt token id")
    assert str(info.value) == "prompt token id must be an integer in [0, 127], got 500"
    with pytest.raises(InvalidParameterError, match=r"^best_of must be an integer >= n \(2\)"):
        check_int(1, "best_of", min=2, allowed="an integer >= n (2)")


def isinstance_checks(expr: ast.expr) -> list[tuple[str, str]]:
    """The (value, type) of each `isinstance(value, type)` in a boolean expression, through
    `and`, `or` and `not`."""
    if isinstance(expr, ast.BoolOp):
        return [check for value in expr.values for check in isinstance_checks(value)]
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return isinstance_checks(expr.operand)
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Name)
        and expr.func.id == "isinstance"
        and len(expr.args) == 2
    ):
        return [(ast.unparse(expr.args[0]), ast.unparse(expr.args[1]))]
    return []


def hand_written_int_checks(tree: ast.AST) -> list[int]:
    """Lines with `isinstance(x, bool) ... isinstance(x, int)` in one condition."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp):
            checks = isinstance_checks(node)
            bools = {value for value, kind in checks if kind == "bool"}
            if any(kind == "int" and value in bools for value, kind in checks):
                found.append(node.lineno)
    return found


def test_the_search_sees_a_hand_written_check() -> None:
    code = "if isinstance(n, bool) or not isinstance(n, int) or n < 1: raise ValueError(n)\n"
    code += "ok = isinstance(x, int) and not isinstance(x, bool)\n"
    code += "number = isinstance(y, bool) or not isinstance(y, int | float)\n"  # not an int check
    assert hand_written_int_checks(ast.parse(code)) == [1, 2]


def test_integers_are_checked_by_check_int_alone() -> None:
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "validation.py":
            continue
        lines = hand_written_int_checks(ast.parse(path.read_text()))
        assert not lines, f"{path.relative_to(SRC)}:{lines}: use validation.check_int"


def window_config(windows: tuple[object, ...]) -> ModelConfig:
    return ModelConfig(
        architecture="mistral",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(windows),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        layer_windows=windows,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("window", [True, 0, 2.0])
def test_a_window_is_a_positive_integer(window: object) -> None:
    with pytest.raises(InvalidParameterError) as info:
        window_config((8, window))
    assert info.value.param == "layer_windows"
    assert str(info.value) == (
        "model config layer_windows entries must be None or a positive number of tokens, "
        f"got {window!r}"
    )
    assert window_config((np.int64(8), None)).layer_windows == (8, None)


def test_a_config_json_window_of_true_is_refused(tmp_path: Path) -> None:
    fields = {"model_type": "mistral", **TINY, "sliding_window": True}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ModelLoadError, match=r"layer_windows entries .* got True$"):
        hf_config(str(tmp_path))


@pytest.mark.parametrize("lora_int_id", [True, 0, 1.0, "1"])
def test_a_lora_id_is_a_positive_integer(lora_int_id: object) -> None:
    with pytest.raises(InvalidParameterError) as info:
        LoRARequest("a", lora_int_id, "p")  # type: ignore[arg-type]
    assert info.value.param == "lora_int_id"
    assert str(info.value) == (
        f"lora_int_id must be an integer >= 1 (0 is the base), got {lora_int_id!r}"
    )
    same = LoRARequest("a", np.int64(3), "p")  # type: ignore[arg-type]
    assert type(same.lora_int_id) is int and same == LoRARequest("a", 3, "p")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"r": True}, "r must be an integer >= 1, got True"),
        ({"r": 2.0}, "r must be an integer >= 1, got 2.0"),
        ({"r": 2, "layers_to_transform": True}, "layers_to_transform must name layers 0..1"),
        ({"r": 2, "layers_to_transform": [0, True]}, "layers_to_transform must name layers"),
    ],
)
def test_an_adapter_rank_and_layers_are_integers(
    tmp_path: Path, fields: dict[str, object], message: str
) -> None:
    config = {"peft_type": "LORA", "target_modules": ["q_proj"], **fields}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidParameterError) as info:
        read_peft_config(tmp_path, num_layers=2, max_lora_rank=8)
    assert info.value.param == "lora_path"
    assert str(info.value).startswith(f"LoRA adapter {tmp_path}: {message}")
    config.update(r=2, layers_to_transform=[1])
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    lora, pairs = read_peft_config(tmp_path, num_layers=2, max_lora_rank=8)
    assert (lora.r, lora.layers, pairs) == (2, (1,), frozenset({(1, "q_proj")}))
