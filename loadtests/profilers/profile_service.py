"""Where the engine replica's serving CPU goes: py-spy on the replica while `bench_service.py`'s
clients stream from it, the samples of its event-loop thread (the HTTP edge) summed by function.

The replica runs its step on its own thread; the edge (uvicorn, the FastAPI app, the SSE writer,
the metrics) runs on Serve's event-loop thread, "AsyncIO Thread: default". py-spy samples with
`--gil`, so a sample is a moment the thread held the GIL: what it ran in Python, and in native
code called with the GIL held (a socket write under uvloop, a Ray metric record). "inclusive" is
the share of the thread's samples under a function, "self" the share where it was on top; the
samples per generated token compare runs of different speed.

    .venv/bin/python loadtests/profilers/profile_service.py [--model transformer-base] [--concurrency 32]
        [--seconds 12] [--raw results/profile_service.raw]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.serve_env import apply_serving_env  # noqa: E402

apply_serving_env([])  # before Ray Serve is imported

import psutil  # noqa: E402

from loadtests.lib.streaming_clients import requests_for, run_service  # noqa: E402
from loadtests.lib.workloads import workload  # noqa: E402
from model.config import PRESETS  # noqa: E402
from model.loading.checkpoint import save_model  # noqa: E402
from model.loading.loading import build_preset  # noqa: E402
from tests.support.local_serve import local_service  # noqa: E402

HTTP_PORT = 18400  # bench_service.py's (the two never run at once)
EVENT_LOOP = "AsyncIO Thread: default"
_LINE = re.compile(r" \(([^)]*):\d+\)")


def replica_pid() -> int:
    for p in psutil.process_iter(["cmdline"]):
        if any("ServeReplica:qkv:EngineDeployment" in part for part in p.info["cmdline"] or ()):
            return p.pid
    raise RuntimeError("no engine replica process")


def summarize(raw: str, thread: str) -> tuple[collections.Counter, collections.Counter, collections.Counter, int]:
    """Samples per thread, and of `thread`'s samples the inclusive and self counts per function."""
    threads, inclusive, own = collections.Counter(), collections.Counter(), collections.Counter()
    for line in raw.splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        name = re.sub(r"thread \(\d+\): ?", "", frames[0])
        threads[name] += int(count)
        if name != thread:
            continue
        functions = [_LINE.sub(r" (\1)", f) for f in frames[1:]]
        for f in set(functions):
            inclusive[f] += int(count)
        if functions:
            own[functions[-1]] += int(count)
    return threads, inclusive, own, threads[thread]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="transformer-base", choices=list(PRESETS))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=int, default=12, help="how long py-spy samples, inside the run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--raw", help="keep py-spy's raw output here")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="qkv-profile-service-")
    save_model(build_preset(args.model), tmp)
    prompts, max_tokens = workload(requests_for(args.concurrency, 4 * args.concurrency), 0, PRESETS[args.model].vocab_size)
    service_args = {"model": tmp, "accelerator": "cpu", "dtype": "float32", "max_num_seqs": max(64, args.concurrency),
                    "engine_num_cpus": 1, "torch_threads": args.threads}
    raw_path = args.raw or str(Path(tmp) / "profile.raw")
    with local_service(service_args, HTTP_PORT, num_cpus=4) as url:
        run_service(url, prompts[:4], [8] * 4, 4)  # warm up
        served: dict = {}
        clients = threading.Thread(target=lambda: served.update(run_service(url, prompts, max_tokens, args.concurrency)))
        clients.start()
        time.sleep(2.0)  # past the first prefills
        spy = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(replica_pid()), "-d",
                              str(args.seconds), "-r", "200", "--gil", "--threads", "-f", "raw", "-o", raw_path],
                             capture_output=True, text=True)
        if spy.returncode != 0:
            raise RuntimeError(f"py-spy failed ({spy.returncode}): {spy.stderr[-2000:]}")
        clients.join()
    threads, inclusive, own, total = summarize(Path(raw_path).read_text(), EVENT_LOOP)
    tokens = served["tokens_per_s"] * args.seconds
    print(f"{args.model}, {args.concurrency} clients: {served['tokens_per_s']:.1f} tok/s; py-spy --gil, {args.seconds:g} s")
    print("\nsamples by thread (the GIL held):")
    for name, n in threads.most_common():
        print(f"  {n:6d}  {name}")
    print(f"\n{EVENT_LOOP}: {total} samples, {total / tokens:.4f} per generated token")
    for title, counts in (("inclusive", inclusive), ("self", own)):
        print(f"\n{title}:")
        for name, n in counts.most_common(args.top):
            print(f"  {n / total:6.1%}  {name}")


if __name__ == "__main__":
    main()
