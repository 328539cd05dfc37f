"""Prefixes shared across replicas (`kv_share_dir`): TTFT of a prompt another engine computed,
loaded from the shared directory, against recomputing it; in one run, on the bare engine (no Ray,
no HTTP), two processes standing for two replicas of one node.

Each round: a child process (replica A) computes P prompts of L tokens with the shared tier and
exits once their blocks are written. Then, in this process (replica B), one request at a time,
alternating: one of A's prompts plus 8 tokens of its own on an engine with the tier (its blocks
loaded from the directory), and a prompt nobody computed, of the same length, on an engine
without it (recomputed: the baseline), and on the engine with the tier (recomputed, its blocks
written: what publishing costs; the writer finishes before the next request). One output token
each: TTFT is the request's whole time.

Directories: /dev/shm (host memory shared by the node's processes) and a temporary directory on
the local disk (`--disk-dir`). Also reported: the bytes of 1,000 tokens of KV and the time to load
them (the tier's load seconds per block), which is what a transfer between replicas moves.

    .venv/bin/python loadtests/benchmarks/bench_kv_share.py [--rounds 3] [--prompts 8] \
        [--prompt-tokens 1000] [--out docs/results/bench_kv_share.json]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
SHARE_BYTES = 8 << 30


POOL_BLOCKS = 640  # ten 1k-token prompts: the pool cycles (and is warm) as a serving replica's is


def engine(model: str, directory: str | None) -> LLM:
    return LLM(model, device="cpu", dtype="float32", engine_config=EngineConfig(
        max_num_seqs=4, num_kv_blocks=POOL_BLOCKS, kv_share_dir=directory,
        kv_share_bytes=SHARE_BYTES if directory else 0))


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab - 1) for _ in range(length)] for _ in range(count)]  # below EOS


def replica_a(model: str, directory: str, vocab: int, count: int, length: int, seed: int) -> None:
    """The child: compute the prompts with the shared tier, wait until their blocks are written."""
    llm = engine(model, directory)
    for p in prompts(vocab, count, length, seed):
        llm.generate([p + [1] * 8], ONE)
    llm.engine.kv_share.flush()
    llm.shutdown()


def ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], ONE)
    return time.perf_counter() - t0


def run_dir(model: str, directory: str, args: argparse.Namespace, vocab: int) -> dict:
    shared, plain = engine(model, directory), engine(model, None)
    times: dict[str, list[float]] = {"loaded": [], "recomputed": [], "recomputed+published": []}
    before = shared.engine.stats()
    for r in range(args.rounds):
        seed = 1000 * r + 1
        child = multiprocessing.get_context("spawn").Process(
            target=replica_a, args=(model, directory, vocab, args.prompts, args.prompt_tokens, seed))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"replica A exited with {child.exitcode}")
        cold = prompts(vocab, 2 * args.prompts, args.prompt_tokens, seed + 500)
        for i, p in enumerate(prompts(vocab, args.prompts, args.prompt_tokens, seed)):
            tail = random.Random(seed + i).choices(range(1, vocab - 1), k=8)
            times["loaded"].append(ttft(shared, p + tail))
            times["recomputed"].append(ttft(plain, cold[2 * i]))
            times["recomputed+published"].append(ttft(shared, cold[2 * i + 1]))
            shared.engine.kv_share.flush()  # its blocks written before the next timed request
    stats = shared.engine.stats()
    loaded = stats.kv_share_loaded_blocks - before.kv_share_loaded_blocks
    load_s = stats.kv_share_load_seconds - before.kv_share_load_seconds
    block_tokens = shared.engine.config.block_size
    result = {"times": times, "loaded_blocks": loaded, "load_seconds": load_s,
              "block_bytes": shared.engine.kv_share.block_nbytes, "block_tokens": block_tokens,
              "errors": stats.kv_share_errors}
    shared.shutdown()
    plain.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-small-random")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts replica A computes each round")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--disk-dir", default="/var/tmp", help="where the disk directory is made")
    add_result_args(ap, None)
    args = ap.parse_args()
    vocab = LLM(args.model, device="cpu", engine_config=EngineConfig(num_kv_blocks=4)).engine.model_config.vocab_size
    places = {"/dev/shm": tempfile.mkdtemp(prefix="qkv-kv-share-", dir="/dev/shm"),
              "disk": tempfile.mkdtemp(prefix="qkv-kv-share-", dir=args.disk_dir)}
    raw = {}
    try:
        for name, directory in places.items():
            raw[name] = run_dir(args.model, directory, args, vocab)
            print(name, {k: round(statistics.median(v) * 1000, 1) for k, v in raw[name]["times"].items()}, flush=True)
    finally:
        for directory in places.values():
            shutil.rmtree(directory, ignore_errors=True)
    columns = ["directory", "TTFT p50 recomputed (ms)", "TTFT p50 loaded (ms)", "speedup",
               "recomputed+published / recomputed", "KV of 1k tokens (MB)", "load 1k tokens (ms)", "errors"]
    rows = []
    for name, res in raw.items():
        p50 = {k: statistics.median(v) for k, v in res["times"].items()}
        per_1k = 1000 / res["block_tokens"]
        rows.append([name, f"{p50['recomputed'] * 1000:.0f}", f"{p50['loaded'] * 1000:.1f}",
                     f"{p50['recomputed'] / p50['loaded']:.1f}x",
                     f"{p50['recomputed+published'] / p50['recomputed']:.3f}",
                     f"{res['block_bytes'] * per_1k / 1e6:.1f}",
                     f"{res['load_seconds'] / max(1, res['loaded_blocks']) * per_1k * 1000:.1f}", res["errors"]])
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "bench_kv_share", columns, rows, note=args.note, raw=raw,
                     title=f"{args.model}: a {args.prompt_tokens}-token prompt computed by another process, "
                           f"loaded from the shared directory vs recomputed ({args.rounds} rounds x "
                           f"{args.prompts} prompts, one request at a time)")


if __name__ == "__main__":
    main()
