"""Peak memory while loading a checkpoint, in a fresh process: its peak resident set (VmHWM)
against its resident set just before the load (torch imported), next to the checkpoint's size and
one copy of the model at the target dtype (the lower bound)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from loadtests.lib.results import write_json

ROOT = Path(__file__).resolve().parents[2]

# Runs in the child: import first (torch's own memory is not the load's), then load.
_CHILD = """
import json, sys, time, torch
from model.loading.checkpoint import load_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
before = status("VmRSS")
t0 = time.perf_counter()
cfg, model = load_model(sys.argv[1], dtype=getattr(torch, sys.argv[2]), device="cpu")
secs = time.perf_counter() - t0
params = sum(p.numel() for p in model.parameters())
print(json.dumps({"params": params, "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "rss_before": before, "peak_rss": status("VmHWM"), "rss_after": status("VmRSS"),
                  "rss_anon_after": status("RssAnon"), "rss_file_after": status("RssFile"), "seconds": secs}))
"""


def measure(directory: str, dtype: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _CHILD, directory, dtype], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def report(directory: str, dtype: str, out: str, files_label: str, extra: dict | None = None) -> dict:
    """Measure loading `directory` into `dtype` in a fresh process, print the table, write `out`
    (with `extra`'s fields)."""
    r = measure(directory, dtype)
    r["file_bytes"] = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))
    r.update(extra or {})
    growth = r["peak_rss"] - r["rss_before"]
    r["peak_growth_over_model_bytes"] = growth / r["model_bytes"]
    gib = 2**30
    print(f"| {'what':<44} | {'GiB':>7} |\n|{'-' * 46}|{'-' * 9}|")
    for what, value in ((files_label, r["file_bytes"]), (f"one copy of the model in {dtype}", r["model_bytes"]),
                        ("RSS before the load (torch imported)", r["rss_before"]),
                        ("peak RSS during the load", r["peak_rss"]), ("peak growth (peak - before)", growth),
                        ("RSS after the load", r["rss_after"])):
        print(f"| {what:<44} | {value / gib:>7.3f} |")
    print(f"{r['params'] / 1e6:.0f}M parameters loaded in {r['seconds']:.1f} s; peak growth = "
          f"{r['peak_growth_over_model_bytes']:.2f}x one {dtype} copy")
    write_json(out, r)
    return r

