"""`loadtests/tools/device_check.py`, run as the GPU machine runs it (a subprocess), on the CPU:
the GPU tests through pytest with their counts in the report (a failed test, or no test passed,
fails the check), the throughput benchmark's whole sequence with tiny shapes (`--dry-run`), and the
docs' result file made of saved reports with their provenance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtests.lib import result_schema
from tests.support.paths import REPO

SCRIPT = REPO / "loadtests" / "tools" / "device_check.py"
# A stand-in for tests/gpu: its own conftest gives the options and marker the repository's does.
CONFTEST = '''
def pytest_addoption(parser):
    parser.addoption("--accel-device", default="cuda")

def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: on an accelerator")
'''
TESTS = '''
import pytest

pytestmark = pytest.mark.gpu

@pytest.fixture
def device(pytestconfig):
    return pytestconfig.getoption("--accel-device")

def test_on_the_device(device):
    assert device == "cpu"

def test_cuda_only(device):
    pytest.skip("CUDA graphs are CUDA's")
'''


def gpu_tests(root: Path, extra: str = "") -> Path:
    folder = root / "fake_gpu"
    folder.mkdir()
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "test_fake_gpu.py").write_text(TESTS + extra)
    return folder


def run(*args: str | Path, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_dry_run_records_the_gpu_tests_and_walks_the_throughput_benchmark(tmp_path: Path) -> None:
    out, result = tmp_path / "device_check.json", tmp_path / "result.json"
    tests = gpu_tests(tmp_path, "\ndef test_another(device):\n    assert device != 'cuda'\n")
    (tests / "test_cpu_only.py").write_text("def test_cpu():\n    pass\n")  # unmarked: deselected by -m gpu
    proc = run("--dry-run", "--tests", tests, "--out", out, "--result", result, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["environment"]["device"] == "cpu"
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["gpu_tests", "throughput", "startup"]
    assert all(c["status"] == "pass" for c in checks.values()), {k: c["status"] for k, c in checks.items()}
    tested = checks["gpu_tests"]["detail"]
    assert {k: tested[k] for k in ("passed", "failed", "errors", "skipped")} == {
        "passed": 2, "failed": 0, "errors": 0, "skipped": 1}
    assert {t["test"].rsplit("::", 1)[1]: t["outcome"] for t in tested["tests"]} == {
        "test_on_the_device": "passed", "test_cuda_only": "skipped", "test_another": "passed"}
    assert "--accel-device cpu" in tested["command"] and tested["returncode"] == 0
    rows = report["throughput"]
    assert {(r["engine"], r["batch"]) for r in rows} >= {("hf generate", 1), ("hf generate", 4)}
    assert all(r["step_ms"] > 0 and r["bytes_per_step"] > 0 and r["flops_per_step"] > 0 for r in rows)
    profiles = checks["throughput"]["detail"]["profiles"]
    assert {p["steps"] for p in profiles.values()} == {5} and all(p["wall_ms_per_step"] > 0 for p in profiles.values())
    startup = checks["startup"]["detail"]  # the tiny shape at 2048 tokens, one request filling them
    assert startup["max_model_len"] == 2048 and startup["generated"] == 8 and startup["finish_reason"] == "length"
    assert set(startup["startup_seconds"]) == {"load", "kv_cache"} and startup["num_kv_blocks"] >= 2048 // 16
    assert "gpu_tests" in proc.stdout and "of roof" in proc.stdout  # the table
    # the report's provenance: the command, the tree's git state and source digest, the machine
    assert "loadtests/tools/device_check.py --dry-run" in report["command"]
    assert len(report["source_digest"]) == 64 and isinstance(report["dirty"], bool)
    assert report["machine"]["torch"] and report["machine"]["gpu"] is None
    assert report["machine"]["copy_bandwidth_gb_s"] > 0  # measured after the benchmark
    # the docs' result file of the same run: a row per throughput row, a row per part
    doc = json.loads(result.read_text())
    assert result_schema.problems(doc) == [] and doc["raw"][0]["checks"] == report["checks"]
    assert len(doc["table"]["rows"]) == len(rows) and [r[0] for r in doc["tables"]["checks"]["rows"]] == list(checks)
    assert {k: doc[k] for k in ("command", "commit", "dirty", "source_digest")} == {
        k: report[k] for k in ("command", "commit", "dirty", "source_digest")}


def test_a_failed_gpu_test_fails_the_check_and_is_named(tmp_path: Path) -> None:
    extra = "\ndef test_broken(device):\n    assert 1 == 2, 'tokens differ'\n"
    out = tmp_path / "device_check.json"
    proc = run("--dry-run", "--tests", gpu_tests(tmp_path, extra), "--out", out, "--skip", "throughput,startup",
               cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (check, *skipped) = json.loads(out.read_text())["checks"]
    assert check["name"] == "gpu_tests" and check["status"] == "fail"
    assert [(c["name"], c["status"]) for c in skipped] == [("throughput", "skipped"), ("startup", "skipped")]
    assert check["detail"]["failed"] == 1 and check["detail"]["passed"] == 1
    (broken,) = [t for t in check["detail"]["tests"] if t["outcome"] == "failed"]
    assert broken["test"].endswith("::test_broken") and "tokens differ" in broken["message"]
    assert "failed: " in proc.stdout and "test_broken" in proc.stdout


def test_a_run_that_passes_no_test_fails(tmp_path: Path) -> None:
    """No test passed (all skipped: no CUDA, no transformers): nothing was checked."""
    out = tmp_path / "device_check.json"
    proc = run("--dry-run", "--tests", gpu_tests(tmp_path), "--pytest-args", "-k cuda_only", "--out", out,
               "--skip", "throughput,startup", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    check = json.loads(out.read_text())["checks"][0]
    assert check["status"] == "fail" and check["detail"]["passed"] == 0 and check["detail"]["skipped"] == 1


def _report(command: str, checks: list[dict], throughput: list[dict], commit: str = "abc1234") -> dict:
    machine = {"cpu_model": "Intel(R) Xeon(R) Processor", "cores": 16, "torch_threads": 16, "load_average_1m": 0.2,
               "copy_bandwidth_gb_s": 4000.0, "matmul_peak_gflops": 47000.0, "gpu": "NVIDIA H200",
               "torch": "2.11.0+cu130", "python": "3.12.3"}
    return {"dry_run": False, "command": command, "date": "2026-12-04", "commit": commit, "dirty": False,
            "source_digest": "0" * 64, "machine": machine,
            "environment": {"device": "cuda", "torch": "2.11.0+cu130", "gpu": "NVIDIA H200", "cuda": "13.0",
                            "transformers": "5.0.0"},
            "checks": checks, "throughput": throughput}


def test_the_result_file_of_two_reports_shows_a_part_rerun_from_the_later_one(tmp_path: Path) -> None:
    """A part that failed in the first device run and passed in a second (rerun after a fix to
    the same code) is shown from the second, the row saying so."""
    failed = {"name": "gpu_tests", "status": "fail", "seconds": 60.0,
              "detail": {"passed": 16, "failed": 1, "errors": 0, "skipped": 0, "tests": []}}
    first = _report("python loadtests/tools/device_check.py",
                    [failed, {"name": "throughput", "status": "pass", "seconds": 2.0, "detail": {}}],
                    [{"engine": "qkv flex+graphs", "batch": 1, "context": 2048, "step_ms": 8.0, "tokens_per_s": 125.0,
                      "roofline_step_ms": 3.2, "roofline_fraction": 0.4}])
    second = _report("python loadtests/tools/device_check.py --skip throughput",
                     [{**failed, "status": "pass", "detail": {**failed["detail"], "passed": 17, "failed": 0}}], [])
    reports = []
    for i, rep in enumerate((first, second)):
        reports.append(tmp_path / f"report{i}.json")
        reports[-1].write_text(json.dumps(rep))
    result = tmp_path / "result.json"
    proc = run("--from", *reports, "--result", result, "--note", "two runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(result.read_text())
    assert result_schema.problems(doc) == [] and result_schema.provenance_problems(doc) == []
    row = doc["tables"]["checks"]["rows"][0]
    assert row[:2] == ["gpu_tests", "pass"] and row[3].startswith("report 2 (report 1: fail)")
    assert doc["command"] == ("report 1: python loadtests/tools/device_check.py; "
                              "report 2: python loadtests/tools/device_check.py --skip throughput")
    assert doc["commit"] == "abc1234" and doc["machine"]["gpu"] == "NVIDIA H200" and doc["note"] == "two runs"
    assert doc["table"]["rows"] == [["qkv flex+graphs", 1, 2048, 8.0, 125.0, 3.2, 40.0]]
    # reports of different code make no one result file
    reports[1].write_text(json.dumps({**second, "commit": "def5678"}))
    proc = run("--from", *reports, "--result", tmp_path / "mixed.json", cwd=tmp_path)
    assert proc.returncode != 0 and "different code" in proc.stderr and not (tmp_path / "mixed.json").exists()
