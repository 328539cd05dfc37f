"""Where the CPU goes while the service streams: CPU seconds of every process over one run.

Starts the service on a local Ray (127.0.0.1 only) with a random-weight preset, warms it up,
then runs `bench_service.py`'s workload with `--clients` streaming clients and prints, per
process (engine replica, ingress replica, Serve's proxy, this script's HTTP clients, Ray's
own), the CPU seconds it used and the share of one core over the run's wall time.

    PYTHONPATH=. .venv/bin/python loadtests/profile_service_cpu.py [--model transformer-base]
        [--clients 32] [--stream-interval-ms 0] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # local_serve: test scaffolding

from bench_service import HTTP_PORT, run_service, workload  # noqa: E402

from local_serve import local_service  # noqa: E402
from model.config import PRESETS  # noqa: E402
from model.loading.checkpoint import save_model  # noqa: E402
from model.loading.loading import build_preset  # noqa: E402


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (command line, user + system CPU seconds so far) of every process we may read."""
    out = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            times = p.cpu_times()
            out[p.pid] = (" ".join(p.info["cmdline"] or [])[:70], times.user + times.system)
        except (psutil.Error, OSError):
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="transformer-base", choices=list(PRESETS))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--stream-interval-ms", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2, help="the engine replica's torch threads")
    ap.add_argument("--top", type=int, default=8, help="processes to print")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="qkv-profile-service-")
    save_model(build_preset(args.model), tmp)
    prompts, max_tokens = workload(args.requests, 0, PRESETS[args.model].vocab_size)
    service_args = {"model": tmp, "accelerator": "cpu", "dtype": "float32", "max_num_seqs": 64,
                    "kv_cache_bytes": 3 << 30, "engine_num_cpus": 1, "torch_threads": args.threads,
                    "stream_interval_ms": args.stream_interval_ms}
    with local_service(service_args, HTTP_PORT, num_cpus=4) as url:
        run_service(url, prompts[:8], max_tokens[:8], 8)  # warm-up
        before = cpu_seconds()
        start = time.perf_counter()
        res = run_service(url, prompts, max_tokens, args.clients)
        wall = time.perf_counter() - start
        after = cpu_seconds()
    used = sorted(((after[p][1] - before[p][1], after[p][0]) for p in after if p in before), reverse=True)
    print(f"{args.model}, {args.clients} clients, stream_interval_ms {args.stream_interval_ms:g}, "
          f"{args.threads} engine threads: {res['tokens_per_s']:.1f} tok/s, {res['tokens_per_chunk']:.2f} "
          f"tokens/chunk, {res['output_tokens']} tokens in {wall:.1f} s")
    print("| CPU s | share of a core | ms per token | process |")
    print("|---|---|---|---|")
    for cpu, cmd in used[:args.top]:
        print(f"| {cpu:.1f} | {cpu / wall:.0%} | {1000 * cpu / res['output_tokens']:.2f} | `{cmd.strip()}` |")


if __name__ == "__main__":
    main()
