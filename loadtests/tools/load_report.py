"""Concurrency sweep against a running OpenAI-compatible server, with a report.

    python loadtests/tools/load_report.py --host http://127.0.0.1:8000 --users 1,4,16,32 \
        --duration 60s --out reports/run1 --slo-ttft-ms 1000 --slo-itl-ms 200

For each level N it runs headless Locust with N users (loadtests/locustfile.py) for --duration,
lets the requests in flight finish (--drain-timeout), and writes
`OUT/users_N/` with Locust's CSV files (`locust_stats.csv`, ...), its HTML report
(`locust.html`) and the per-request records (`requests.jsonl`). Across levels it writes
`OUT/summary.json` and `OUT/load_report.png`, and prints a Markdown table. Arguments after
`--` go to Locust unchanged (e.g. `-- --long-max-tokens 128 --tags stream`).

Exit status: 0 when every level is within --max-error-rate and --max-slo-miss-rate, 1 when a
level is not, 2 when Locust could not run or recorded no request.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from loadtests.lib.load_summary import (LevelSummary, Slo, markdown_table, plot, read_records,  # noqa: E402
                                        summarize, write_summary)

logger = logging.getLogger("load_report")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; everything after `--` is passed to Locust."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="http://127.0.0.1:8000", help="base URL of the server")
    p.add_argument("--users", default="1,4,16,32", help="comma-separated concurrency levels")
    p.add_argument("--duration", default="60s", help="Locust run time per level (e.g. 30s, 2m)")
    p.add_argument("--out", type=Path, default=Path("reports") / time.strftime("load-%Y%m%d-%H%M%S"))
    p.add_argument("--model", default="", help="model field of each request (default: the served one)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT objective per request")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="objective on a request's mean ITL")
    p.add_argument("--slo-e2e-ms", type=float, default=None, help="end-to-end objective per request")
    p.add_argument("--max-error-rate", type=float, default=0.0, help="fail above this failed fraction")
    p.add_argument("--max-slo-miss-rate", type=float, default=1.0,
                   help="fail above this fraction of successful requests missing an SLO")
    p.add_argument("--drain-timeout", type=int, default=120,
                   help="seconds a user may take to finish its request in flight when the time is up; "
                        "their tokens count, so long requests at high concurrency are not dropped")
    p.add_argument("--pause", type=float, default=2.0, help="seconds between levels (server drains)")
    p.add_argument("--title", default="", help="plot title (default: host and date)")
    p.add_argument("--from-records", action="store_true",
                   help="do not run Locust; rebuild the summary from OUT/users_N/requests.jsonl")
    args = p.parse_args(argv)
    args.locust_args = extra
    try:
        args.levels = [int(u) for u in args.users.split(",") if u.strip()]
    except ValueError:
        p.error(f"--users must be comma-separated integers, got {args.users!r}")
    if not args.levels or min(args.levels) < 1:
        p.error(f"--users needs levels >= 1, got {args.users!r}")
    return args


def run_level(args: argparse.Namespace, users: int, level_dir: Path) -> int:
    """Run headless Locust with `users` users; return its exit status (1 = some request failed)."""
    level_dir.mkdir(parents=True, exist_ok=True)
    records = level_dir / "requests.jsonl"
    records.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "locust", "-f", str(HERE.parent / "locustfile.py"), "--headless",
        "-u", str(users), "-r", str(users), "-t", args.duration, "-H", args.host,
        "--csv", str(level_dir / "locust"), "--csv-full-history", "--html", str(level_dir / "locust.html"),
        "--records-file", str(records), "--only-summary", "--loglevel", "WARNING",
        "--stop-timeout", str(args.drain_timeout),
    ]
    if args.model:
        cmd += ["--model", args.model]
    cmd += args.locust_args
    logger.info("level %d users: %s", users, " ".join(cmd))
    with (level_dir / "locust.log").open("w") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode


def check(levels: list[LevelSummary], args: argparse.Namespace) -> list[str]:
    """Why the sweep misses its thresholds (empty when it does not)."""
    problems = []
    for lv in levels:
        if lv.error_rate > args.max_error_rate:
            problems.append(f"{lv.users} users: error rate {lv.error_rate:.2%} > {args.max_error_rate:.2%} "
                            f"({lv.failed} of {lv.requests} requests failed)")
        if lv.slo_miss_rate > args.max_slo_miss_rate:
            problems.append(f"{lv.users} users: SLO miss rate {lv.slo_miss_rate:.2%} "
                            f"> {args.max_slo_miss_rate:.2%}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Run the sweep (unless --from-records), write the report, return the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms, args.slo_e2e_ms)
    levels: list[LevelSummary] = []
    # The load generator shares the machine with whatever else runs: keep the load average
    # around each level in the report, so a noisy neighbour is visible.
    loadavg: dict[int, list[float]] = {}
    for i, users in enumerate(args.levels):
        level_dir = args.out / f"users_{users}"
        if not args.from_records:
            if i:
                time.sleep(args.pause)
            before = os.getloadavg()[0]
            rc = run_level(args, users, level_dir)
            loadavg[users] = [round(before, 2), round(os.getloadavg()[0], 2)]
            if rc not in (0, 1):  # 1 only means some request failed, which the summary counts
                print(f"locust exited with {rc} at {users} users; see {level_dir / 'locust.log'}")
                return 2
        records = read_records(level_dir / "requests.jsonl")
        if not records:
            print(f"no request was recorded at {users} users; see {level_dir / 'locust.log'}")
            return 2
        levels.append(summarize(users, records, slo))
    meta = {"host": args.host, "duration": args.duration, "drain_timeout_s": args.drain_timeout, "model": args.model or None,
            "slo": vars(slo), "locust_args": args.locust_args,
            "cpus": os.cpu_count(), "loadavg_1m_before_after": loadavg, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_summary(args.out / "summary.json", levels, meta)
    plot(args.out / "load_report.png", levels, args.title or f"{args.host}  {meta['created']}")
    print(markdown_table(levels))
    print(f"\nreport: {args.out / 'summary.json'}, {args.out / 'load_report.png'}")
    problems = check(levels, args)
    for msg in problems:
        print(f"THRESHOLD MISSED: {msg}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
