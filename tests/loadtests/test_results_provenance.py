"""Every result file says where its figures came from (CONVENTIONS 25): the script that measured
them wrote, through loadtests/lib/results.py, the command line, a clean git commit (or the dirty
tree, recorded with --allow-dirty), and the machine (CPU model, cores, GPU or none, torch). A file
for docs/results/ from a dirty tree is refused unless --allow-dirty is given, before the run; a
run on a machine without the tree's git history is adopted by a clean checkout with the same
source digest, never given a commit by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from loadtests.lib import provenance, result_schema, results
from tests.support.paths import REPO

RESULTS = REPO / "docs" / "results"

# Result files measured before their scripts wrote this provenance, and what each lacks. Each must
# be measured again by its script (the command in its "command" field) on a clean checkout, which
# replaces the file, and then leave this list; the list only shrinks (a file on it that has its
# provenance fails the test, and so does a file off it that lacks it). None could be completed
# honestly: no file records the torch version it ran with, nor (but by its commit's suffix)
# whether its tree was clean.
MEASURED_WITHOUT_PROVENANCE = {
    "bench_llama_cpp.json": "no torch version, no dirty flag",
    "bench_pd_transfer_pool_copy.json": "its commit was set by hand (the GPU machine's copy wrote 21924dc-dirty); "
                                        "no torch version",
    "device_check.json": "command and commit 'not recorded'; no CPU model or cores",
}
CLEAN = provenance.RunStart("python loadtests/benchmarks/demo.py --out x.json", "abc1234", False, "0" * 64)


def result_files() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


@pytest.mark.parametrize("path", result_files(), ids=lambda p: p.name)
def test_every_result_file_has_its_provenance(path: Path) -> None:
    missing = result_schema.provenance_problems(json.loads(path.read_text()))
    if path.name in MEASURED_WITHOUT_PROVENANCE:
        assert missing, f"{path.name} has its provenance now: take it off MEASURED_WITHOUT_PROVENANCE"
    else:
        assert not missing, f"{path.name}: {'; '.join(missing)} (write it with its script: loadtests/lib/results.py)"


def test_the_list_names_result_files_that_exist() -> None:
    gone = sorted(set(MEASURED_WITHOUT_PROVENANCE) - {p.name for p in result_files()})
    assert not gone, f"MEASURED_WITHOUT_PROVENANCE names files that are gone: {gone}"


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A run started from a clean tree, its machine's bounds not measured (seconds each), and
    docs/results/ standing at tmp_path/published."""
    from loadtests.lib import rooflines

    monkeypatch.setattr(rooflines, "copy_bandwidth_gbs", lambda device: 10.0)
    monkeypatch.setattr(rooflines, "matmul_gflops", lambda device, dtype: 100.0)
    monkeypatch.setattr(results, "_run", CLEAN)
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path / "published")
    return tmp_path / "published"


def test_a_result_file_carries_the_command_commit_and_machine(measured: Path) -> None:
    doc = results.write_result(measured / "demo.json", "demo", ["case", "tok/s"], [["a", 1.5]], raw={"x": 1})
    assert json.loads((measured / "demo.json").read_text()) == doc
    assert result_schema.provenance_problems(doc) == [] and result_schema.problems(doc) == []
    assert doc["command"] == CLEAN.command and doc["commit"] == "abc1234" and doc["dirty"] is False
    assert "allow_dirty" not in doc and doc["source_digest"] == "0" * 64
    machine = doc["machine"]
    assert machine["torch"] == torch.__version__ and machine["cores"] == os.cpu_count() and machine["gpu"] is None
    assert machine["cpu_model"] == provenance.cpu_model() and machine["copy_bandwidth_gb_s"] == 10.0


def test_a_published_file_from_a_dirty_tree_is_refused_unless_allowed(measured: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    columns, rows = ["case", "tok/s"], [["a", 1.5]]
    monkeypatch.setattr(results, "_run", provenance.RunStart(CLEAN.command, "abc1234", True, "0" * 64))
    with pytest.raises(results.RefusedResult, match="uncommitted changes"):
        results.write_result(measured / "demo.json", "demo", columns, rows)
    assert not (measured / "demo.json").exists()
    elsewhere = results.write_result(measured.parent / "mine.json", "demo", columns, rows)  # not published: recorded
    assert elsewhere["dirty"] is True and result_schema.provenance_problems(elsewhere)
    monkeypatch.setattr(results, "_run", provenance.RunStart(CLEAN.command, "abc1234", True, "0" * 64, True))
    doc = results.write_result(measured / "demo.json", "demo", columns, rows)
    assert doc["dirty"] is True and doc["allow_dirty"] is True and result_schema.provenance_problems(doc) == []
    monkeypatch.setattr(results, "_run", provenance.RunStart(CLEAN.command, None, True, "0" * 64, True))
    with pytest.raises(results.RefusedResult, match="not a git commit"):
        results.write_result(measured / "demo.json", "demo", columns, rows)


def test_the_command_line_refuses_a_dirty_tree_before_the_run(measured: Path, monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    dirty = provenance.RunStart(CLEAN.command, "abc1234", True, "0" * 64)
    monkeypatch.setattr(provenance, "start", lambda allow_dirty=False: dirty)
    ap = argparse.ArgumentParser()
    results.add_result_args(ap, None)
    with pytest.raises(SystemExit) as exit_:
        ap.parse_args(["--out", str(measured / "x.json")])
    assert exit_.value.code == 2
    assert ap.parse_args(["--out", str(tmp_path / "x.json")]).out == str(tmp_path / "x.json")
    assert ap.parse_args(["--out", str(measured / "x.json"), "--allow-dirty"]).allow_dirty is True
    assert ap.parse_args([]).out is None


def test_a_scripts_own_json_carries_the_provenance_too(measured: Path, tmp_path: Path) -> None:
    doc = results.write_json(tmp_path / "profile.json", {"runs": [1, 2]})
    assert doc["runs"] == [1, 2] and result_schema.provenance_problems(doc) == []
    assert "copy_bandwidth_gb_s" not in doc["machine"]  # the bounds take seconds: result files only
    with pytest.raises(ValueError, match="provenance"):
        results.write_json(tmp_path / "bad.json", {"commit": "mine"})


def test_what_provenance_problems_catches() -> None:
    good = {"command": CLEAN.command, "date": "2026-12-05", "commit": "abc1234", "dirty": False,
            "machine": {"cpu_model": "Some CPU", "cores": 2, "gpu": None, "torch": "2.13.0"}}
    assert result_schema.provenance_problems(good) == []
    for change, words in (({"command": "not recorded"}, "command"), ({"commit": "abc1234-dirty"}, "not a git commit"),
                          ({"commit": None}, "not a git commit"), ({"dirty": True}, "uncommitted changes"),
                          ({"dirty": None}, "true or false"), ({"date": "today"}, "ISO date"),
                          ({"machine": {**good["machine"], "torch": None}}, "torch"),
                          ({"machine": {k: v for k, v in good["machine"].items() if k != "gpu"}}, "gpu"),
                          ({"machine": {**good["machine"], "cores": None}}, "cores")):
        assert any(words in p for p in result_schema.provenance_problems(good | change)), change
    assert result_schema.provenance_problems(good | {"dirty": True, "allow_dirty": True}) == []


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=root,
                          capture_output=True, text=True, check=True).stdout.strip()


def test_a_run_elsewhere_is_adopted_only_by_a_clean_checkout_of_the_same_source(tmp_path: Path) -> None:
    """The GPU machine's copy has no git history: its stamp names no commit, but its source
    digest; a clean checkout whose source has that digest gives it its commit."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.py").write_text("x = 1\n")
    assert provenance.git_state(tmp_path) == (None, True)  # not a checkout (yet)
    elsewhere = {"command": "python loadtests/tools/device_check.py", "commit": None, "dirty": True,
                 "source_digest": provenance.source_digest(tmp_path)}
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "model")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    adopted = provenance.adopt(elsewhere, root=tmp_path)
    assert adopted["commit"] == head and adopted["dirty"] is False and "commit_from" in adopted
    assert result_schema.tree_problems(adopted["commit"], adopted["dirty"], False) == []
    (tmp_path / "model" / "a.py").write_text("x = 2\n")  # the checkout's source differs now, and is dirty
    assert provenance.adopt(elsewhere, root=tmp_path) == elsewhere
    _git(tmp_path, "commit", "-q", "-am", "two")  # clean, but not the code that ran
    assert provenance.adopt(elsewhere, root=tmp_path) == elsewhere
    assert provenance.git_state(tmp_path) == (_git(tmp_path, "rev-parse", "--short", "HEAD"), False)
