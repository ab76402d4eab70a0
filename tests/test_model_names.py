"""Model names as users type them: `pagedllm serve MODEL` (the same as --model MODEL), and
`org/name` found in the local Hugging Face cache (a fake hub in tmp: a tiny random Llama
saved with save_pretrained into models--org--name/snapshots/abc/, its files symlinks to
blobs/ as the hub client leaves them, refs/main = abc), never downloaded; a name the cache
lacks gets a message saying where it looked."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.entrypoints.llm import LLM
from pagedllm.entrypoints.server.app import default_model_name, served_names
from pagedllm.errors import ModelLoadError
from pagedllm.loader import resolve_model_path
from pagedllm.loader.hf_cache import is_repo_id
from pagedllm.sampling_params import SamplingParams

REPO = "tiny-org/tiny-llama"


def hub_layout(cache: Path, repo_id: str, model_dir: Path, revision: str = "abc") -> Path:
    """`model_dir`'s files as the hub client caches them; the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for i, f in enumerate(sorted(model_dir.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache holding REPO, named by $HF_HUB_CACHE; the snapshot folder."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return hub_layout(tmp_path / "hub", REPO, tiny_llama_dir)


@pytest.mark.parametrize(
    ("name", "is_id"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("org/name.v2", True),
        ("org_x/a_b", True),
        ("name", False),
        ("a/b/c", False),
        ("./name", False),
        ("../name", False),
        ("/abs/path", False),
        ("org/na--me", False),
        ("org/.hidden", False),
        ("org/name.", False),
        ("org/", False),
        ("org/nàme", False),
    ],
)
def test_what_is_a_hub_name(name: str, is_id: bool) -> None:
    assert is_repo_id(name) is is_id


@pytest.mark.parametrize("setting", ["HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HOME"])
def test_a_hub_name_resolves_to_its_cached_snapshot(
    setting: str, tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(setting, str(tmp_path / "root"))
    cache = {
        "HF_HUB_CACHE": tmp_path / "root",
        "HF_HOME": tmp_path / "root" / "hub",
        "XDG_CACHE_HOME": tmp_path / "root" / "huggingface" / "hub",
        "HOME": tmp_path / "root" / ".cache" / "huggingface" / "hub",  # none set
    }[setting]
    snapshot = hub_layout(cache, REPO, tiny_llama_dir)
    assert resolve_model_path(REPO) == str(snapshot)


def test_the_revision_is_the_one_refs_main_names(hub: Path, tiny_llama_dir: Path) -> None:
    repo = hub.parent.parent
    (repo / "snapshots" / "older").mkdir()
    assert resolve_model_path(REPO) == str(hub)
    (repo / "refs" / "main").write_text("gone\n")
    with pytest.raises(ModelLoadError, match="refs/main names 'gone'"):
        resolve_model_path(REPO)
    (repo / "refs" / "main").unlink()  # no ref: only a lone snapshot is unambiguous
    with pytest.raises(ModelLoadError, match=r"no refs/main .*\(abc, older\)"):
        resolve_model_path(REPO)
    shutil.rmtree(repo / "snapshots" / "older")
    assert resolve_model_path(REPO) == str(hub)


def test_a_gguf_repository_loads_its_one_gguf(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshot = tmp_path / "models--org--m-GGUF" / "snapshots" / "r1"
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("a model")
    (snapshot / "m.Q4_0.gguf").write_bytes(b"GGUF")
    assert resolve_model_path("org/m-GGUF") == str(snapshot / "m.Q4_0.gguf")
    (snapshot / "m.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"several GGUF files \(m.Q4_0.gguf, m.Q8_0.gguf\)"):
        resolve_model_path("org/m-GGUF")


def test_a_name_the_cache_lacks_says_where_it_looked(hub: Path, capsys) -> None:
    cache = hub.parent.parent.parent
    (hub.parent.parent / "refs" / "main").write_text("../../escape")  # a name, not a path
    with pytest.raises(ModelLoadError, match=r"refs/main names '\.\./\.\./escape'"):
        resolve_model_path(REPO)
    with pytest.raises(ModelLoadError) as info:
        resolve_model_path("tiny-org/other")
    message = str(info.value)
    assert str(cache / "models--tiny-org--other" / "snapshots") in message
    assert "$HF_HUB_CACHE" in message and "hf download tiny-org/other" in message
    # The command line says the same, in one line, before anything loads.
    assert main(["generate", "--model", "tiny-org/other", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tiny-org/other' is neither a local path nor" in err[0], err


def test_a_local_folder_of_that_name_comes_first(hub: Path, tmp_path: Path, monkeypatch) -> None:
    local = tmp_path / "here" / REPO
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "here")
    assert resolve_model_path(REPO) == REPO
    assert default_model_name(REPO) == "tiny-llama"  # a path: its folder's name


def test_llm_and_generate_load_a_hub_name(hub: Path, tiny_llama_dir: Path, tmp_path, capsys):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(num_kv_blocks=32, block_size=4)
    want = LLM(str(tiny_llama_dir), **options).generate([[1, 2, 3]], params, use_tqdm=False)
    got = LLM(REPO, **options).generate([[1, 2, 3]], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    argv = ["generate", "--model", REPO, "--prompts-file", str(prompts), "--max-tokens", "6"]
    assert main([*argv, "--ignore-eos", "--num-kv-blocks", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["generated_tokens"] == 6


def serve_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_serve_takes_the_model_as_its_argument(hub: Path, monkeypatch, capsys) -> None:
    from pagedllm.entrypoints.server import shutdown

    served = []
    monkeypatch.setattr(shutdown, "serve", lambda app, timeout, **kw: served.append(app))
    for argv in ([REPO], ["--model", REPO], [REPO, "--model", REPO]):
        args = serve_args([*argv, "--num-kv-blocks", "32", "--no-kv-view"])
        assert args.func(args) == 0
        app = served.pop()
        assert app.state.model_name == REPO  # a hub name is served as given, as vLLM does
        assert app.state.engine.config.model == REPO
    args = serve_args([REPO, "--num-kv-blocks", "32", "--served-model-name", "a", "b", "a"])
    assert args.served_model_name == ["a", "b", "a"]
    assert args.func(args) == 0
    assert served.pop().state.model_name == "a"
    # Two different models: refused before either loads.
    capsys.readouterr()
    assert main(["serve", REPO, "--model", "other/model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the model is given twice" in err[0], err


def test_served_names() -> None:
    assert served_names(None, None) == ("SmolLM2-135M-Instruct",)
    assert served_names(None, "/models/Foo.Q4_0.gguf") == ("Foo.Q4_0",)
    assert served_names(None, "org/name") == ("org/name",)
    assert served_names("x", "org/name") == ("x",)
    assert served_names(["x", "y", "x"], None) == ("x", "y")
    for bad in ([], [""], ["x", 3]):
        with pytest.raises(ValueError, match="served model names"):
            served_names(bad, None)  # type: ignore[arg-type]
