"""Locust against the real service: a short headless run of loadtests/locustfile.py must not
fail a single request, its CSV and per-request records must show every scenario, and
loadtests/tools/load_report.py must summarise it (and exit non-zero when an SLO is missed).
The SSE checks that make a request fail are tested without a server.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.local_serve import SharedServe
from tests.support.serve_fixtures import REPO, write_tiny_model

from loadtests.lib.openai_workload import RequestResult, StreamError, read_stream  # on sys.path via serve_fixtures
from loadtests.lib.load_summary import Slo, summarize

USERS, RUN_TIME = 4, "15s"
SHORT_MAX, LONG_MAX = 8, 16
LOCUST_OPTS = ["--short-max-tokens", str(SHORT_MAX), "--long-max-tokens", str(LONG_MAX),
               "--long-prompt-words", "30", "--loglevel", "WARNING"]
SCENARIOS = {"chat short (stream)": SHORT_MAX, "chat short": SHORT_MAX,
             "completion long (stream)": LONG_MAX, "completion long": LONG_MAX}


def _chunk(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text}]})


USAGE = "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})


def _read(lines: list[str]) -> RequestResult:
    result = RequestResult(scenario="t", stream=True, start=0.0)
    read_stream(lines, result, t0=0.0)
    return result


def test_a_well_formed_stream_yields_ttft_gaps_and_usage() -> None:
    result = _read([_chunk("a"), "", ": keep-alive", _chunk("b"), _chunk("c"), USAGE, "data: [DONE]"])
    assert result.ttft is not None and len(result.itl) == 2
    assert (result.prompt_tokens, result.completion_tokens) == (5, 3)


@pytest.mark.parametrize("lines, reason", [
    ([_chunk("a"), USAGE], "without data: [DONE]"),
    ([_chunk("a"), 'data: {"error": {"message": "boom"}}', "data: [DONE]"], "error event"),
    ([_chunk("a"), "event: nonsense", USAGE, "data: [DONE]"], "malformed SSE line"),
    ([_chunk("a"), "data: {not json", USAGE, "data: [DONE]"], "malformed SSE JSON"),
    ([_chunk("a"), "data: [DONE]"], "no usage chunk"),
    ([_chunk("a"), USAGE, "data: [DONE]", _chunk("b")], "data after [DONE]"),
])
def test_a_broken_stream_fails_the_request(lines: list[str], reason: str) -> None:
    with pytest.raises(StreamError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        _read(lines)


def test_summary_counts_errors_and_goodput_under_an_slo() -> None:
    def rec(ttft: float | None, e2e: float, tokens: int, error: str | None = None) -> dict[str, Any]:
        return {"start": 100.0, "e2e": e2e, "ttft": ttft, "itl": [0.01] * max(tokens - 1, 0), "tpot": None,
                "prompt_tokens": 4, "completion_tokens": tokens, "error": error}

    records = [rec(0.05, 1.0, 10), rec(0.30, 2.0, 10), rec(None, 0.08, 10), rec(None, 0.5, 0, "HTTP 503")]
    lv = summarize(4, records, Slo(ttft_ms=100))
    assert (lv.requests, lv.failed, lv.error_rate) == (4, 1, 0.25)
    assert lv.duration_s == 2.0 and lv.requests_per_s == 1.5 and lv.output_tokens_per_s == 15.0
    # Good: the stream with TTFT 50 ms and the non-stream answered in 80 ms (its TTFT is its e2e).
    assert lv.goodput_rps == 1.0 and lv.slo_miss_rate == round(1 / 3, 4)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, shared_serve: SharedServe) -> Any:
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    args = {"model": str(model), "max_num_seqs": 8, "engine_num_cpus": 1, "router_num_cpus": 0.25}
    with shared_serve(args) as url:
        yield url


def run_locust(url: str, out: Path, run_time: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """Headless Locust writing CSV and records under `out` (the load report's level layout)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO / "loadtests" / "locustfile.py"), "--headless",
           "-u", str(USERS), "-r", str(USERS), "-t", run_time, "-H", url, "--only-summary",
           "--csv", str(out / "locust"), "--records-file", str(out / "requests.jsonl"), *LOCUST_OPTS, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def _stats(out: Path) -> dict[tuple[str, str], dict[str, str]]:
    with (out / "locust_stats.csv").open() as fh:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(fh)}


@pytest.mark.slow
def test_locust_smoke_serves_every_scenario_without_a_failure(service: str, tmp_path: Path) -> None:
    level = tmp_path / f"users_{USERS}"
    proc = run_locust(service, level, RUN_TIME)
    assert proc.returncode == 0, f"locust failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    stats = _stats(level)
    assert int(stats[("", "Aggregated")]["Failure Count"]) == 0
    for name in SCENARIOS:
        assert int(stats[("POST", name)]["Request Count"]) > 0, name
        assert ("E2E", name) in stats
    for name in ("chat short (stream)", "completion long (stream)"):
        assert ("TTFT", name) in stats and ("ITL", name) in stats
    records = [json.loads(line) for line in (level / "requests.jsonl").read_text().splitlines()]
    assert records and all(r["error"] is None and r["status"] == 200 for r in records)
    assert all(r["completion_tokens"] == SCENARIOS[r["scenario"]] for r in records)
    assert all(r["ttft"] is not None for r in records if r["stream"])

    report = [sys.executable, str(REPO / "loadtests" / "tools" / "load_report.py"), "--from-records", "--users", str(USERS),
              "--out", str(tmp_path)]
    ok = subprocess.run(report, capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (summary,) = json.loads((tmp_path / "summary.json").read_text())["levels"]
    assert summary["requests"] == len(records) and summary["error_rate"] == 0
    assert summary["output_tokens_per_s"] > 0 and summary["ttft_ms"]["p50"] > 0
    assert (tmp_path / "load_report.png").stat().st_size > 0
    missed = subprocess.run(report + ["--slo-ttft-ms", "0.001", "--max-slo-miss-rate", "0.5"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert missed.returncode == 1 and "SLO miss rate" in missed.stdout, missed.stdout + missed.stderr


@pytest.mark.slow
def test_locust_fails_requests_the_service_rejects(service: str, tmp_path: Path) -> None:
    proc = run_locust(service, tmp_path, "3s", "--model", "no-such-model")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert records and all(r["status"] == 404 and r["error"].startswith("HTTP 404") for r in records)
