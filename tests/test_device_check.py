"""`loadtests/device_check.py --dry-run`: the GPU check's whole sequence on the CPU with tiny
shapes, as a subprocess (as it runs on the device machine), so that it cannot fail there for a typo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_walks_every_check_and_writes_its_json(tmp_path) -> None:
    out = tmp_path / "device_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "loadtests" / "device_check.py"), "--dry-run", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["environment"]["device"] == "cpu"
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["parity", "batch_invariance", "backends", "graphs", "throughput"]
    assert all(c["status"] == "pass" for c in checks.values()), {k: c["status"] for k, c in checks.items()}
    parity = checks["parity"]["detail"]
    assert sorted(parity) == ["gpt2", "llama", "qwen3", "transformer"]
    assert all(p["prompts"] >= 2 for p in parity.values())
    backends = checks["backends"]["detail"]
    assert backends["engine_tokens_equal"] is True
    assert all(0 < e <= backends["tolerance"] for case in backends["max_abs_err"].values() for e in case.values())
    assert checks["graphs"]["detail"]["auto_equal"] is True and checks["graphs"]["detail"]["auto_static_steps"] > 0
    rows = report["throughput"]
    assert {(r["engine"], r["batch"]) for r in rows} >= {("hf generate", 1), ("hf generate", 4)}
    assert all(r["step_ms"] > 0 and r["bytes_per_step"] > 0 and r["flops_per_step"] > 0 for r in rows)
    assert "parity" in proc.stdout and "of roof" in proc.stdout  # the table
