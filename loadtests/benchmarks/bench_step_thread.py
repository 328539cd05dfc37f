"""The engine's decode step on the replica's step thread, three thread layouts against each other
in one run (no Ray: the replica's situation reproduced in a plain process).

Each layout runs in a fresh process started with OMP_NUM_THREADS=1 (what Ray gives a replica of
`engine_num_cpus: 1`) whose main thread calls `torch.set_num_threads(--threads)`, as the replica does:
- `before`: the engine built on a helper thread (the replica's old `asyncio.to_thread`), its steps
  on a new step thread that never set torch's thread count;
- `set-only`: the same, the step thread calling `torch.set_num_threads` first;
- `torch-thread`: `service.engine.engine_loop.TorchThread`, one thread that builds the engine and steps it.
The step: `--batch` sequences of a `--context`-token context, one decode step each (the runner's
`run`, sampling included); the median of `--steps` steps and the process's CPU over them (user +
system, in cores). Layouts run in turn, `--rounds` times; the table gives each layout's median
step and its ratio to `torch-thread` per round (median, and the spread).

`--noise F`: beside each layout, a process at nice 0 keeps busy a fraction F of one core in 1 ms
bursts, and the layout's process runs at nice 15 (Ray's `worker_niceness`): a replica's situation,
where HAProxy, the clients and Ray's daemons take short turns on the same cores.

    .venv/bin/python loadtests/benchmarks/bench_step_thread.py [--model transformer-base-trained] [--batch 16]
        [--rounds 5] [--noise 0.3] [--out step_thread.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from loadtests.lib.results import write_json  # noqa: E402

LAYOUTS = ("before", "set-only", "torch-thread")


def child(args: argparse.Namespace) -> None:
    """One layout in this process; prints one JSON line."""
    import psutil
    import torch

    from model.config import EngineConfig
    from model.engine.builder import build_engine
    from model.engine.engine import Engine
    from model.engine.scheduler import ScheduledSeq
    from loadtests.lib.engine_steps import fill
    from service.engine.engine_loop import TorchThread

    torch.set_num_threads(args.threads)
    if args.noise:
        os.nice(15)

    def build() -> Engine:
        eng = build_engine(args.model, EngineConfig(max_num_seqs=max(args.batch, 8)), dtype="float32")
        fill(eng, args.batch, args.context, args.steps + 8, eng.model_config.vocab_size)
        return eng

    def steps(eng: Engine, set_threads: bool) -> dict:
        if set_threads:
            torch.set_num_threads(args.threads)
        seqs = list(eng.scheduler.running)
        times = []
        cpu0 = psutil.Process().cpu_times()
        start = time.perf_counter()
        for i in range(args.steps + 2):
            for s in seqs:  # the next token's block, as the scheduler would grow it
                eng.scheduler.blocks.grow(s, s.num_computed_tokens + 1)
            t0 = time.perf_counter()
            eng.runner.run([ScheduledSeq(s, 1) for s in seqs], [eng._row(s) for s in seqs])
            if i >= 2:  # the first two: warm-up
                times.append(time.perf_counter() - t0)
        wall, cpu1 = time.perf_counter() - start, psutil.Process().cpu_times()
        cores = ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / wall
        return {"step_ms": statistics.median(times) * 1e3, "cores": cores}

    result: dict = {}
    if args.child == "torch-thread":
        worker = TorchThread(torch.get_num_threads())
        eng = worker.submit(build).result()
        result = worker.submit(lambda: steps(eng, False)).result()
    else:
        built: list[Engine] = []
        helper = threading.Thread(target=lambda: built.append(build()))
        helper.start()
        helper.join()
        stepper = threading.Thread(target=lambda: result.update(steps(built[0], args.child == "set-only")))
        stepper.start()
        stepper.join()
    print(json.dumps(result), flush=True)


def noise(fraction: float) -> None:
    """Busy `fraction` of one core, in bursts of 1 ms, until killed."""
    while True:
        end = time.perf_counter() + 1e-3
        while time.perf_counter() < end:
            pass
        time.sleep(1e-3 * (1 - fraction) / fraction)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="transformer-base-trained")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--noise", type=float, default=0.0, help="a busy process beside each layout: this share of a core")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", choices=LAYOUTS, help=argparse.SUPPRESS)
    ap.add_argument("--noise-child", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.noise_child:
        noise(args.noise_child)
    if args.child:
        child(args)
        return
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    rounds: list[dict] = []
    for r in range(args.rounds):
        one = {}
        order = LAYOUTS if r % 2 == 0 else tuple(reversed(LAYOUTS))  # drift hits every layout alike
        for layout in order:
            cmd = [sys.executable, __file__, "--child", layout] + [
                f"--{k}={v}" for k, v in vars(args).items() if k in ("model", "batch", "context", "steps", "threads", "noise")]
            busy = subprocess.Popen([sys.executable, __file__, f"--noise-child={args.noise}"]) if args.noise else None
            try:
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
            one[layout] = json.loads(done.stdout.strip().splitlines()[-1])
        rounds.append(one)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v['step_ms']:.1f} ms on {v['cores']:.2f} cores"
                                             for k, v in one.items()), flush=True)
    print(f"\n{args.model}, batch {args.batch}, context {args.context}, {args.threads} threads, "
          f"OMP_NUM_THREADS=1, noise {args.noise} of a core, {args.rounds} rounds")
    print("| layout | step (median) | cores (median) | step / torch-thread's, per round |")
    print("|---|---:|---:|---|")
    table = []
    for layout in LAYOUTS:
        ms = statistics.median(r[layout]["step_ms"] for r in rounds)
        cores = statistics.median(r[layout]["cores"] for r in rounds)
        ratios = sorted(r[layout]["step_ms"] / r["torch-thread"]["step_ms"] for r in rounds)
        table.append({"layout": layout, "step_ms": ms, "cores": cores, "ratios": ratios})
        print(f"| {layout} | {ms:.1f} ms | {cores:.2f} | {statistics.median(ratios):.2f}x "
              f"({ratios[0]:.2f}-{ratios[-1]:.2f}) |")
    if args.out:
        write_json(args.out, {"args": vars(args), "rounds": rounds, "table": table})


if __name__ == "__main__":
    main()
