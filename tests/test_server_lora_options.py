"""The server's LoRA options without a model: `--lora-modules` parsing, the adapters a
server serves by name (ids never reused), the LoRA directory a load must stay inside,
and the option combinations `pagedllm serve` refuses before it loads anything."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.entrypoints.server.app import check_lora_options
from pagedllm.entrypoints.server.lora_modules import (
    LoRAModule,
    ServedModels,
    check_lora_path,
    module_requests,
    parse_lora_modules,
)
from pagedllm.errors import InvalidParameterError
from pagedllm.lora import LoRARequest


def test_lora_modules_as_name_path_and_as_json() -> None:
    modules = parse_lora_modules(
        ["sql=/a/sql", '{"name": "chat", "path": "/b/chat", "base_model_name": "x"}', "eq=/p=q"]
    )
    assert modules == (
        LoRAModule("sql", "/a/sql"),
        LoRAModule("chat", "/b/chat"),
        LoRAModule("eq", "/p=q"),  # only the first '=' splits
    )
    assert module_requests(modules) == [
        LoRARequest("sql", 1, "/a/sql"),
        LoRARequest("chat", 2, "/b/chat"),
        LoRARequest("eq", 3, "/p=q"),
    ]
    assert parse_lora_modules(None) == ()


@pytest.mark.parametrize(
    ("values", "words"),
    [
        (["sql"], "name=path or JSON"),
        (["=/a"], "non-empty string"),
        (["sql="], "needs a non-empty path"),
        (["a=/x", "a=/y"], "'a' is given more than once"),
        (['{"name": "a"}'], 'needs "name" and "path"'),
        (['{"name": "a", "path": "/x", "rank": 4}'], "['rank']"),
        (["{not json"], "not valid JSON"),
        (['{"name": 3, "path": "/x"}'], "non-empty string"),
    ],
)
def test_bad_lora_modules_name_the_option(values: list[str], words: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        parse_lora_modules(values)
    assert info.value.param == "lora_modules"
    assert words in str(info.value)


def test_served_models_ids_in_order_and_never_reused() -> None:
    models = ServedModels(["tiny", "alias"], "/m", [LoRAModule("a", "/x"), LoRAModule("b", "/y")])
    assert models.names() == ["tiny", "alias", "a", "b"]
    assert "alias" in models and "b" in models and "c" not in models
    assert models.lora("tiny") is None and models.lora(None) is None
    assert models.lora("b") == LoRARequest("b", 2, "/y")
    with pytest.raises(KeyError):
        models.lora("c")

    removed = models.remove("a")
    assert removed.lora_int_id == 1 and "a" not in models
    again = models.new_request("a", "/x")
    assert again.lora_int_id == 3  # a fresh id: the engine retired 1
    models.add(again)
    assert [a.lora_int_id for a in models.adapters()] == [2, 3]
    # A load that failed its check still used up its id.
    assert models.new_request("c", "/z").lora_int_id == 4
    assert models.new_request("c", "/z").lora_int_id == 5


def test_served_models_refuse_taken_names() -> None:
    models = ServedModels(["tiny"], "/m", [LoRAModule("a", "/x")])
    for name, words in [("a", "already been loaded"), ("tiny", "base model's name")]:
        with pytest.raises(InvalidParameterError) as info:
            models.new_request(name, "/z")
        assert info.value.param == "lora_name" and words in str(info.value)
    late = models.new_request("b", "/z")
    models.add(models.new_request("b", "/w"))  # a second load of the name won the race
    with pytest.raises(InvalidParameterError, match="already been loaded"):
        models.add(late)
    with pytest.raises(InvalidParameterError, match="base model's name"):
        ServedModels(["tiny"], "/m", [LoRAModule("tiny", "/x")])


def test_model_cards_of_base_and_adapters() -> None:
    models = ServedModels(["tiny"], "/models/tiny", [LoRAModule("a", "/ad/a")])
    cards = [c.model_dump(exclude={"created"}) for c in models.cards(512)]
    assert cards == [
        dict(
            id="tiny",
            object="model",
            owned_by="pagedllm",
            root="/models/tiny",
            parent=None,
            max_model_len=512,
        ),
        dict(
            id="a",
            object="model",
            owned_by="pagedllm",
            root="/ad/a",
            parent="tiny",
            max_model_len=512,
        ),
    ]


def test_lora_path_stays_inside_the_lora_dir(tmp_path: Path) -> None:
    root = tmp_path / "loras"
    (root / "a").mkdir(parents=True)
    (root / "team" / "b").mkdir(parents=True)
    outside = tmp_path / "secret"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    (root / "inner").symlink_to(root / "a")
    (root / "c").mkdir()  # an adapter folder whose config links out
    (outside / "adapter_config.json").write_text("{}")
    (root / "c" / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    real = os.path.realpath
    assert check_lora_path(str(root / "a"), str(root)) == real(root / "a")
    assert check_lora_path("a", str(root)) == real(root / "a")  # relative: under the dir
    assert check_lora_path("team/b", str(root)) == real(root / "team" / "b")
    assert check_lora_path("team/../a", str(root)) == real(root / "a")
    assert check_lora_path("inner", str(root)) == real(root / "a")  # a link that stays in
    for bad in [
        str(outside),
        "../secret",
        "a/../../secret",
        "escape",  # a symlink out
        "c",  # a file in it links out
        str(root),  # the directory itself is no adapter
        "/etc",
        "missing",
        "",
        "a\x00b",
    ]:
        with pytest.raises(InvalidParameterError) as info:
            check_lora_path(bad, str(root))
        assert info.value.param == "lora_path", bad
    with pytest.raises(InvalidParameterError):
        check_lora_path(3, str(root))


def test_lora_option_combinations(tmp_path: Path) -> None:
    module = (LoRAModule("a", "/x"),)
    assert check_lora_options(True, module, False, None) is None
    assert check_lora_options(True, (), True, str(tmp_path)) == os.path.realpath(tmp_path)
    for args, words in [
        ((False, module, False, None), "need --enable-lora"),
        ((False, (), True, str(tmp_path)), "need --enable-lora"),
        ((True, (), True, None), "needs --lora-dir"),
        ((True, (), True, str(tmp_path / "no")), "is not a folder"),
        ((True, (), False, str(tmp_path)), "only with --enable-lora-loading"),
    ]:
        with pytest.raises(ValueError, match=words):
            check_lora_options(*args)


def test_serve_parses_the_lora_flags() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "m",
            "--enable-lora",
            "--lora-modules",
            "a=/x",
            '{"name": "b", "path": "/y"}',
            "--enable-lora-loading",
            "--lora-dir",
            "/loras",
        ]
    )
    assert args.enable_lora and args.enable_lora_loading
    assert args.lora_modules == ["a=/x", '{"name": "b", "path": "/y"}']
    assert args.lora_dir == "/loras"
    plain = build_parser().parse_args(["serve", "m"])
    assert plain.lora_modules is None and not plain.enable_lora_loading and plain.lora_dir is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-modules", "a=/x"], "need --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "name=path or JSON"),
        (["--enable-lora", "--enable-lora-loading"], "needs --lora-dir"),
        (["--enable-lora", "--ray", "--enable-lora-loading", "--lora-dir", "."], "with --ray"),
    ],
)
def test_serve_refuses_bad_lora_options_before_loading(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tiny_llama_dir: Path
) -> None:
    assert main(["serve", str(tiny_llama_dir), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_ray_serve_refuses_runtime_loading() -> None:
    pytest.importorskip("ray.serve")
    from pagedllm.engine.config import EngineConfig
    from pagedllm.entrypoints.ray_serve.app import build_app

    with pytest.raises(ValueError, match="must reach every engine replica"):
        build_app(EngineConfig(enable_lora=True), enable_lora_loading=True, lora_dir="/x")
