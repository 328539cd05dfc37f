"""HF hub ids resolved through `huggingface_hub` and its cache, offline: the tests lay out a
Hugging Face cache themselves (`models--org--name/{refs,blobs,snapshots}`); nothing downloads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.ingress_stub import stub_ingress
from model import LLM, SamplingParams
from model.config import EngineConfig
from model.loading.hub import HubModelNotFoundError, resolve_model_dir
from model.loading.tokenizer import ByteTokenizer
from service.app import AppArgs
from tests.support.tiny_models import save_tiny_gpt2
from tests.support.paths import REPO

MAIN, V1 = "a" * 40, "b" * 40  # commit hashes of two snapshots
ENGINE = EngineConfig(kv_cache_memory_bytes=4 << 20)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _add_snapshot(repo_dir: Path, commit: str, checkpoint: Path) -> Path:
    """The checkpoint's files as a cached snapshot: the config files as symlinks into blobs/
    (as huggingface_hub stores them), the rest as plain files."""
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for file in checkpoint.iterdir():
        if file.suffix == ".json":
            blob = repo_dir / "blobs" / f"{commit[:8]}-{file.name}"
            shutil.copy(file, blob)
            (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
        else:
            shutil.copy(file, snapshot / file.name)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding `org/tiny`: main -> a tiny GPT-2 (seed 0), tag v1 -> another (seed 1)."""
    root = tmp_path_factory.mktemp("hf")
    cache = root / "hub"
    repo_dir = cache / "models--org--tiny"
    _add_snapshot(repo_dir, MAIN, save_tiny_gpt2(root / "seed0", seed=0))
    _add_snapshot(repo_dir, V1, save_tiny_gpt2(root / "seed1", seed=1))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(MAIN)
    (repo_dir / "refs" / "v1").write_text(V1)
    return cache


@pytest.fixture
def offline(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process sees `hub_cache` as its Hugging Face cache, in offline mode (what
    HF_HUB_CACHE and HF_HUB_OFFLINE=1 set when huggingface_hub is imported)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def test_llm_loads_a_hub_id_from_the_cache_named_by_the_environment(hub_cache: Path) -> None:
    """A fresh process with HF_HUB_CACHE and HF_HUB_OFFLINE=1, as a user would run it."""
    script = ("import json; from model import LLM, SamplingParams; from model.config import EngineConfig\n"
              "p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)\n"
              "e = EngineConfig(kv_cache_memory_bytes=4 << 20)\n"
              "print(json.dumps([LLM('org/tiny', device='cpu', engine_config=e).generate('The cat', p)[0].token_ids,"
              " LLM('org/tiny', revision='v1', device='cpu', engine_config=e).generate('The cat', p)[0].token_ids]))")
    env = os.environ | {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    main_ids, v1_ids = json.loads(run.stdout.strip().splitlines()[-1])
    snapshots = hub_cache / "models--org--tiny" / "snapshots"
    for ids, commit in ((main_ids, MAIN), (v1_ids, V1)):
        direct = LLM(str(snapshots / commit), device="cpu", engine_config=ENGINE)
        assert ids == direct.generate("The cat", GREEDY)[0].token_ids
    assert main_ids != v1_ids  # the revision picked the other snapshot


def test_revisions_resolve_through_refs_or_a_commit_hash(offline: Path) -> None:
    snapshots = offline / "models--org--tiny" / "snapshots"
    assert Path(resolve_model_dir("org/tiny")) == snapshots / MAIN
    assert Path(resolve_model_dir("org/tiny", revision="v1")) == snapshots / V1
    assert Path(resolve_model_dir("org/tiny", revision=V1)) == snapshots / V1


def test_an_uncached_id_offline_says_how_to_download_it(offline: Path) -> None:
    with pytest.raises(HubModelNotFoundError, match="not found in the local Hugging Face cache") as err:
        LLM("org/missing", device="cpu")
    assert "hf download org/missing" in str(err.value) and str(offline) in str(err.value)
    with pytest.raises(HubModelNotFoundError, match=r"revision 'v9' .*hf download org/tiny --revision v9"):
        resolve_model_dir("org/tiny", revision="v9")
    with pytest.raises(ValueError, match="a preset .*, a checkpoint directory or an HF hub id"):
        LLM("no-such-model", device="cpu")


def test_a_local_directory_wins_over_a_hub_id(offline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = save_tiny_gpt2(tmp_path / "org" / "tiny", seed=2)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("org/tiny") == "org/tiny"
    ids = LLM("org/tiny", device="cpu", engine_config=ENGINE).generate("The cat", GREEDY)[0].token_ids
    assert ids == LLM(str(local), device="cpu", engine_config=ENGINE).generate("The cat", GREEDY)[0].token_ids


def test_only_the_files_a_checkpoint_needs_are_fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The configs and tokenizer files first, then only the shards the index lists (a repo may
    also hold consolidated or .bin copies of the same weights)."""
    import huggingface_hub

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    calls: list[tuple[str, str | None, list[str]]] = []

    def fake_download(repo_id: str, revision: str | None = None, allow_patterns: list[str] | None = None,
                      **kwargs: object) -> str:
        calls.append((repo_id, revision, list(allow_patterns or [])))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model_dir("org/sharded", revision="r1") == str(tmp_path)
    (_, rev, first), (_, _, second) = calls
    assert rev == "r1" and {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                            "model.safetensors.index.json", "preprocessor_config.json", "chat_template.json"} <= set(first)
    assert not any("*" in p or p.endswith((".bin", ".pth", ".pt")) for p in first)
    assert second == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_the_service_serves_a_hub_id_under_its_name() -> None:
    assert AppArgs(model="org/tiny").resolved_name() == "org/tiny"
    assert AppArgs(model="/models/tiny/").resolved_name() == "tiny"
    client, _, _ = stub_ingress(ByteTokenizer(), name="org/tiny", max_model_len=128)
    card = client.get("/v1/models/org/tiny").json()
    assert card["id"] == "org/tiny" and card["object"] == "model" and card["max_model_len"] == 128
    assert client.get("/v1/models").json()["data"] == [card]
    missing = client.get("/v1/models/org/other")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found" and missing.json()["error"]["param"] == "model"
    # A request may name only the served model.
    r = client.post("/v1/completions", json={"model": "org/other", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 404
