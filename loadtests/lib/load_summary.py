"""Summaries and plots of a load sweep, computed from the per-request records Locust wrote.

Each concurrency level is one JSON-lines file of `RequestResult.to_record()` dicts. Latencies
are computed from those records (exact percentiles, not Locust's rounded histogram), as is
goodput: the successful requests that met every SLO given, per second.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.lib.results import write_json

logger = logging.getLogger(__name__)

QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives in milliseconds; None means not judged.

    A non-streamed request shows its first token with the whole response, so its TTFT is its
    end-to-end latency; its inter-token latency cannot be observed and is not judged.
    The ITL objective applies to a request's mean time per output token after the first.
    """

    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, rec: dict[str, Any]) -> bool:
        """True when a successful request `rec` meets every objective given."""
        ttft = rec["ttft"] if rec.get("ttft") is not None else rec["e2e"]
        if self.ttft_ms is not None and ttft * 1e3 > self.ttft_ms:
            return False
        tpot = rec.get("tpot")
        if self.itl_ms is not None and tpot is not None and tpot * 1e3 > self.itl_ms:
            return False
        return not (self.e2e_ms is not None and rec["e2e"] * 1e3 > self.e2e_ms)


@dataclass
class LevelSummary:
    """One concurrency level; times in milliseconds, rates per second."""

    users: int
    requests: int
    failed: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    goodput_rps: float
    error_rate: float
    slo_miss_rate: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of one level; an absent file is an empty level."""
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _quantiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 in milliseconds of `values` given in seconds (None when empty)."""
    if not values:
        return {f"p{q}": None for q in QUANTILES}
    arr = np.asarray(values, dtype=float) * 1e3
    return {f"p{q}": round(float(np.percentile(arr, q)), 2) for q in QUANTILES}


def summarize(users: int, records: list[dict[str, Any]], slo: Slo) -> LevelSummary:
    """Throughput, latency quantiles, error rate and goodput of one level's records."""
    ok = [r for r in records if r.get("error") is None]
    failed = len(records) - len(ok)
    if records:
        t_start = min(r["start"] for r in records)
        t_end = max(r["start"] + r["e2e"] for r in records)
        duration = max(t_end - t_start, 1e-9)
    else:
        duration = 0.0
    good = sum(1 for r in ok if slo.met(r))

    def per_s(x: float) -> float:
        return round(x / duration, 3) if duration else 0.0

    return LevelSummary(
        users=users,
        requests=len(records),
        failed=failed,
        duration_s=round(duration, 2),
        requests_per_s=per_s(len(ok)),
        output_tokens_per_s=per_s(sum(r["completion_tokens"] for r in ok)),
        goodput_rps=per_s(good),
        error_rate=round(failed / len(records), 4) if records else 1.0,
        slo_miss_rate=round(1 - good / len(ok), 4) if ok else 1.0,
        mean_prompt_tokens=round(float(np.mean([r["prompt_tokens"] for r in ok])), 1) if ok else 0.0,
        mean_output_tokens=round(float(np.mean([r["completion_tokens"] for r in ok])), 1) if ok else 0.0,
        ttft_ms=_quantiles([r["ttft"] for r in ok if r.get("ttft") is not None]),
        itl_ms=_quantiles([gap for r in ok for gap in r.get("itl", [])]),
        e2e_ms=_quantiles([r["e2e"] for r in ok]),
    )


def write_summary(path: Path, levels: list[LevelSummary], meta: dict[str, Any]) -> None:
    """The summary JSON: run parameters under `meta`, one entry per level under `levels`, and
    the provenance every script's JSON carries (loadtests/lib/results.py)."""
    write_json(path, {"meta": meta, "levels": [asdict(lv) for lv in levels]})


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def markdown_table(levels: list[LevelSummary]) -> str:
    """A Markdown table of the sweep, one row per level."""
    head = ("| users | req/s | out tok/s | goodput req/s | errors | TTFT p50/p90/p99 ms "
            "| ITL p50/p90/p99 ms | E2E p50/p90/p99 ms |")
    rows = [head, "|" + "---|" * 8]
    for lv in levels:
        q = [" / ".join(_fmt(d[f"p{p}"]) for p in QUANTILES) for d in (lv.ttft_ms, lv.itl_ms, lv.e2e_ms)]
        rows.append(f"| {lv.users} | {lv.requests_per_s:.2f} | {lv.output_tokens_per_s:.1f} "
                    f"| {lv.goodput_rps:.2f} | {lv.failed}/{lv.requests} | {q[0]} | {q[1]} | {q[2]} |")
    return "\n".join(rows)


def plot(path: Path, levels: list[LevelSummary], title: str) -> None:
    """One PNG: throughput and goodput, then TTFT, ITL and E2E quantiles, against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    users = [lv.users for lv in levels]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    ax.plot(users, [lv.output_tokens_per_s for lv in levels], "o-", label="output tokens/s")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(users, [lv.requests_per_s for lv in levels], "s--", color="tab:green", label="requests/s")
    ax2.plot(users, [lv.goodput_rps for lv in levels], "^:", color="tab:red", label="goodput req/s")
    ax2.set_ylabel("requests/s")
    ax2.set_ylim(bottom=0)
    ax.set_title("throughput")
    ax.legend(loc="upper left")
    ax2.legend(loc="lower right")
    panels = (("TTFT", "ttft_ms"), ("inter-token latency", "itl_ms"), ("end-to-end latency", "e2e_ms"))
    for ax, (name, key) in zip((axes[0][1], axes[1][0], axes[1][1]), panels):
        for q in QUANTILES:
            ys = [getattr(lv, key)[f"p{q}"] for lv in levels]
            ax.plot(users, [np.nan if y is None else y for y in ys], "o-", label=f"p{q}")
        ax.set_title(name)
        ax.set_ylabel("ms")
        ax.legend()
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(users, [str(u) for u in users])
        ax.set_xlabel("concurrent users")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
