"""`compile_cache_dir` (model/engine/builder.py `use_compile_cache`): torch.compile's Inductor
cache goes where the engine is told, so every process and replica reuses what one compiled."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from model.engine.builder import use_compile_cache
from tests.support.paths import REPO

_COMPILE_IN_A_FRESH_PROCESS = """
import sys, torch
from model.config import EngineConfig
from model.engine.builder import build_engine
build_engine("transformer-base", EngineConfig(compile_cache_dir=sys.argv[1], max_model_len=64), device="cpu")
f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
print(f(torch.ones(8)).sum().item())
"""


def test_an_explicit_directory_wins_and_the_default_yields_to_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    assert use_compile_cache(None) == tmp_path / "theirs"  # the default does not override the user's
    assert use_compile_cache(str(tmp_path / "ours")) == tmp_path / "ours"
    assert (tmp_path / "ours").is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "ours")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="compile_cache_dir .* cannot be created"):
        use_compile_cache(str(tmp_path / "file" / "below"))


@pytest.mark.slow
def test_what_a_process_compiles_lands_in_the_directory(tmp_path) -> None:
    cache = tmp_path / "compile"
    env_free = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_IN_A_FRESH_PROCESS, str(cache)], cwd=REPO, env=env_free,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split()[-1]) == pytest.approx(8 * (2 * 0.8414709848 + 1), rel=1e-5)
    assert any(p.is_file() for p in cache.rglob("*")), "nothing compiled into compile_cache_dir"
