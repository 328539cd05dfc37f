"""The fairness benchmark in its --quick form (loadtests/benchmarks/bench_tenant_fairness.py): two
quiet tenants beside one that sends 10x its share, on a real local Ray Serve, first with one shared
key and then with a keys file. What must hold (timings are the benchmark's, never asserted here):
with tenants the flood's excess is answered 429 while every quiet request succeeds; with one key
nothing is refused and everything queues together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.paths import REPO

pytestmark = pytest.mark.slow


def test_the_fairness_benchmark_runs_and_the_flood_is_refused_with_tenants(tmp_path: Path) -> None:
    out = tmp_path / "fairness.json"
    run = subprocess.run([sys.executable, str(REPO / "loadtests" / "benchmarks" / "bench_tenant_fairness.py"),
                          "--quick", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    raw = doc["raw"]
    tenants, first_come = raw["tenants"], raw["first_come"]
    for mode in (tenants, first_come):
        for phase in ("unloaded", "loaded"):
            assert mode[phase]["requests"] > 0 and mode[phase]["success"] == 1.0, (phase, mode[phase])
    assert tenants["noisy"]["statuses"].get("429", 0) > 0 and set(tenants["noisy"]["statuses"]) <= {"200", "429"}
    assert set(first_come["noisy"]["statuses"]) == {"200"}
    assert tenants["at_share"]["success"] == 1.0 and tenants["ledger_ms"] > 0
    assert [row[0] for row in doc["table"]["rows"]] == ["first come (one key)", "tenants (keys file)"]
