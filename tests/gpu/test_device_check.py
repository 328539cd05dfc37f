"""`loadtests/tools/device_check.py --dry-run`: the GPU check's whole sequence on the CPU with tiny
shapes, as a subprocess (as it runs on the device machine), so that it cannot fail there for a typo;
and a check that could not run (no transformers) fails rather than passes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from loadtests.tools import results
from tests.support.paths import REPO

ROOT = REPO


def test_dry_run_walks_every_check_and_writes_its_json(tmp_path) -> None:
    out = tmp_path / "device_check.json"
    result = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(ROOT / "loadtests" / "tools" / "device_check.py"), "--dry-run", "--out", str(out),
                           "--result", str(result)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["environment"]["device"] == "cpu"
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["parity", "batch_invariance", "backends", "graphs", "sampling", "prefix_cache",
                            "spec_decode", "long_context", "throughput"]
    assert all(c["status"] == "pass" for c in checks.values()), {k: c["status"] for k, c in checks.items()}
    parity = checks["parity"]["detail"]
    assert sorted(parity) == ["gpt2", "llama", "qwen3", "transformer"]
    assert all(p["prompts"] >= 2 for p in parity.values())
    backends = checks["backends"]["detail"]
    assert backends["engine_tokens_equal"] is True
    assert all(0 < e <= backends["tolerance"] for case in backends["max_abs_err"].values() for e in case.values())
    assert checks["graphs"]["detail"]["auto_equal"] is True and checks["graphs"]["detail"]["auto_static_steps"] > 0
    assert checks["sampling"]["detail"]["seed_batch_invariant"] is True
    assert checks["prefix_cache"]["detail"]["equal"] is True and checks["prefix_cache"]["detail"]["cached_tokens"] > 0
    spec = checks["spec_decode"]["detail"]
    assert spec["ngram"]["drafts"] > 0 and spec["draft_model"]["drafts"] > 0
    assert checks["long_context"]["detail"]["workspace_blocks"] == 0
    assert any(k.startswith("prefill5-") for case in backends["max_abs_err"].values() for k in case)
    rows = report["throughput"]
    assert {(r["engine"], r["batch"]) for r in rows} >= {("hf generate", 1), ("hf generate", 4)}
    assert all(r["step_ms"] > 0 and r["bytes_per_step"] > 0 and r["flops_per_step"] > 0 for r in rows)
    assert "parity" in proc.stdout and "of roof" in proc.stdout  # the table
    profiles = checks["throughput"]["detail"]["profiles"]
    assert {p["steps"] for p in profiles.values()} == {5} and all(p["wall_ms_per_step"] > 0 for p in profiles.values())
    # the docs' result file of the same run: the schema docs/results/ holds, a row per throughput row
    doc = json.loads(result.read_text())
    assert results.problems(doc) == []
    assert len(doc["table"]["rows"]) == len(rows) and doc["raw"][0]["checks"] == report["checks"]
    assert [r[0] for r in doc["tables"]["checks"]["rows"]] == list(checks)
    assert doc["machine"]["cores"] and doc["machine"]["gpu"] is None


def test_a_check_failed_in_one_report_is_shown_from_the_later_report_that_passed_it(tmp_path) -> None:
    """Two device runs (the second re-running a check fixed between them) make one result file,
    whose checks table says which report each row comes from."""
    device_check = _module()
    check = {"name": "spec_decode", "status": "fail", "seconds": 1.0, "detail": {"ngram": {"drafts": 0}}}
    first = {"command": "python a", "commit": "abc", "date": "2026-12-04",
             "environment": {"device": "cuda", "torch": "2.11", "gpu": "H200"},
             "checks": [check, {"name": "throughput", "status": "pass", "seconds": 2.0, "detail": {}}],
             "throughput": [{"engine": "qkv flex+graphs", "batch": 1, "context": 2048, "step_ms": 8.0,
                             "tokens_per_s": 125.0, "roofline_step_ms": 3.2, "roofline_fraction": 0.4}]}
    second = {"command": "python b", "environment": first["environment"], "throughput": [],
              "checks": [{**check, "status": "pass", "detail": {"ngram": {"drafts": 38}}}]}
    doc = device_check.write_docs_result(str(tmp_path / "r.json"), [first, second], "two runs")
    assert results.problems(doc) == []
    spec_row = doc["tables"]["checks"]["rows"][0]
    assert spec_row[:2] == ["spec_decode", "pass"] and spec_row[3].startswith("report 2 (report 1: fail)")
    assert doc["command"] == "report 1: python a; report 2: python b" and doc["machine"]["gpu"] == "H200"
    assert doc["table"]["rows"] == [["qkv flex+graphs", 1, 2048, 8.0, 125.0, 3.2, 40.0]]


def _module():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "loadtests" / "tools" / "device_check.py")
    device_check = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = device_check  # its dataclasses look it up
    spec.loader.exec_module(device_check)
    return device_check


def test_what_could_not_be_checked_fails(tmp_path, monkeypatch) -> None:
    """Without transformers the parity check has nothing to compare with: a failure, not a pass."""
    device_check = _module()
    monkeypatch.setattr(device_check, "have_transformers", lambda: False)
    check = device_check.check_parity(device_check.DRY, tmp_path)
    assert check.status == "fail"
    assert check.detail["llama"]["not_checked"] == "transformers is not installed"
    assert check.detail["transformer"]["ok"] is True  # the paper's model has its own reference
