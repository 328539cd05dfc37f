"""`loadtests/tools/device_check.py --dry-run`: the GPU check's whole sequence on the CPU with tiny
shapes, as a subprocess (as it runs on the device machine), so that it cannot fail there for a typo;
and a check that could not run (no transformers) fails rather than passes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_walks_every_check_and_writes_its_json(tmp_path) -> None:
    out = tmp_path / "device_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "loadtests" / "tools" / "device_check.py"), "--dry-run", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
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


def test_what_could_not_be_checked_fails(tmp_path, monkeypatch) -> None:
    """Without transformers the parity check has nothing to compare with: a failure, not a pass."""
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "loadtests" / "tools" / "device_check.py")
    device_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "device_check", device_check)  # its dataclasses look it up
    spec.loader.exec_module(device_check)
    monkeypatch.setattr(device_check, "have_transformers", lambda: False)
    check = device_check.check_parity(device_check.DRY, tmp_path)
    assert check.status == "fail"
    assert check.detail["llama"]["not_checked"] == "transformers is not installed"
    assert check.detail["transformer"]["ok"] is True  # the paper's model has its own reference
