"""Prefill/decode disaggregation: what moving a prompt's KV blocks between two processes costs, and
TTFT prefilled remotely against prefilled in place; in one run, on a local Ray (no Serve, no HTTP):
a Ray actor stands for the prefill replica, this process for the decode replica, and the blocks go
through the same connector the service uses (service/replica/kv_connector.py: Ray's object store).

Each round, one request at a time: a prompt of L tokens prefilled by the actor (one token), its
blocks exported, put in the object store, fetched here, received by the decode engine and used
when it decodes the prompt's first token ("disaggregated"); and a prompt nobody computed, of the
same length, prefilled here ("colocated"). The steps of a transfer are timed where they run:
export (pool -> one host tensor), put, fetch (object store -> this process), copy into the pool.

Also, on paper (the `paper` table): the KV bytes of 1,000 tokens of an 8B model (Llama-3.1-8B's
shape: 32 layers, 8 KV heads of 128, bf16) and their time over NVLink, PCIe and TCP at the links'
nominal rates, beside its prefill time on one H200 at a stated share of the GPU's peak.

    .venv/bin/python loadtests/benchmarks/bench_pd_transfer.py [--rounds 3] [--prompts 6] \
        [--prompt-tokens 1000] [--out docs/results/bench_pd_transfer.json]

`--pool-copy --device cuda`: only the engine's two copies of a transfer on a GPU (no Ray), for a
pool of the 8B shape above: the export (pool -> one host tensor, `PoolBlocks.copy_out_many`) and
the copy into the pool (`IncomingBlocks.add`, then `load` block by block as at admission), for
1,000 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
POOL_BLOCKS = 640  # ten 1k-token prompts: the pool cycles (and is warm) as a serving replica's is

# On paper: an 8B model's KV per token (Llama-3.1-8B: 32 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes)
KV_BYTES_PER_TOKEN_8B = 32 * 2 * 8 * 128 * 2
LINKS_GBPS = {  # nominal one-direction rates, GB/s
    "NVLink 4 (H100/H200, 18 links)": 450.0,
    "PCIe 5.0 x16": 64.0,
    "TCP, 100 Gb/s Ethernet": 12.5,
    "TCP, 25 Gb/s Ethernet": 3.125,
}
H200_BF16_DENSE_TFLOPS = 989.0  # the GPU's peak; a prefill reaches a share of it
PREFILL_SHARE = 0.5  # assumed share of the peak for a 1k-token prefill (a stated assumption, not a measurement)
PARAMS_8B = 8.0e9


def engine(model: str) -> LLM:
    return LLM(model, device="cpu", dtype="float32", engine_config=EngineConfig(max_num_seqs=4, num_kv_blocks=POOL_BLOCKS))


def prefill_actor_class():
    import ray

    from service.replica.kv_connector import RayObjectStoreConnector

    @ray.remote(num_cpus=1)
    class Prefill:
        def __init__(self, model: str, threads: int) -> None:
            import torch

            torch.set_num_threads(threads)
            self.llm = engine(model)
            self.connector = RayObjectStoreConnector()

        def prefill(self, prompt: list[int]):
            t0 = time.perf_counter()
            self.llm.generate([prompt], ONE)
            t1 = time.perf_counter()
            blocks = self.llm.engine.export_prefix(prompt)
            t2 = time.perf_counter()
            transfer = self.connector.send(blocks)
            t3 = time.perf_counter()
            return transfer, {"prefill": t1 - t0, "export": t2 - t1, "put": t3 - t2}

    return Prefill


def paper() -> tuple[list[str], list[list[str]]]:
    nbytes = KV_BYTES_PER_TOKEN_8B * 1000
    prefill_ms = 2 * PARAMS_8B * 1000 / (H200_BF16_DENSE_TFLOPS * 1e12 * PREFILL_SHARE) * 1000
    columns = ["link", "KV of 1k tokens, 8B bf16 (MB)", "transfer (ms)", "prefill of 1k tokens on one H200 (ms)",
               "transfer / prefill"]
    rows = [[link, f"{nbytes / 1e6:.0f}", f"{nbytes / (gbps * 1e9) * 1000:.1f}", f"{prefill_ms:.0f}",
             f"{nbytes / (gbps * 1e9) * 1000 / prefill_ms:.2f}"] for link, gbps in LINKS_GBPS.items()]
    return columns, rows


def pool_copy(args: argparse.Namespace) -> None:
    """The export and copy-in of 1,000 tokens of KV in an 8B-shaped pool on `args.device`."""
    import torch

    from model.engine.kv.offload import PoolBlocks
    from model.engine.kv.transfer import IncomingBlocks, KVBlocks

    block, blocks = 16, -(-1000 // 16)
    dtype = torch.bfloat16
    tensors = [torch.randn(4 * blocks, block, 8, 128, dtype=dtype, device=args.device) for _ in range(32 * 2)]
    pool = PoolBlocks(tensors)
    run = list(range(blocks, 2 * blocks))
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {"export": [], "copy in": []}
    for i in range(args.rounds * args.prompts + 1):
        sync()
        t0 = time.perf_counter()
        data = pool.copy_out_many(run)
        sync()
        t1 = time.perf_counter()
        incoming = IncomingBlocks(pool)  # as the decode engine takes them: kept, then copied in at admission
        keys = [b"%d" % j for j in range(blocks)]
        incoming.add(KVBlocks(keys, data, pool.block_nbytes, "bench"))
        for key, b in zip(keys, range(2 * blocks, 3 * blocks)):
            assert incoming.load(key, b)
        sync()
        t2 = time.perf_counter()
        if i:  # the first is the warm-up
            times["export"].append(t1 - t0)
            times["copy in"].append(t2 - t1)
    assert torch.equal(tensors[5][2 * blocks:3 * blocks], tensors[5][blocks:2 * blocks])
    p50 = {k: statistics.median(v) * 1000 for k, v in times.items()}
    mb = blocks * pool.block_nbytes / 1e6
    columns = ["device", "KV of 1k tokens, 8B bf16 (MB)", "export (ms)", "copy in (ms)", "export GB/s", "copy in GB/s"]
    rows = [[args.device, f"{mb:.0f}", f"{p50['export']:.1f}", f"{p50['copy in']:.1f}",
             f"{mb / p50['export']:.1f}", f"{mb / p50['copy in']:.1f}"]]
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "bench_pd_transfer_pool_copy", columns, rows, note=args.note, raw=times,
                     device=args.device, title="The engine's copies of a transfer of 1,000 tokens of an 8B-shaped "
                                               "KV pool (bf16): export to the host, copy back in (ms, medians)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-small-random")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=6, help="requests of each kind per round")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each engine")
    ap.add_argument("--pool-copy", action="store_true", help="only the engine's copies, 8B-shaped, on --device")
    ap.add_argument("--device", default="cpu")
    add_result_args(ap, None)
    args = ap.parse_args()
    if args.pool_copy:
        pool_copy(args)
        return

    import ray
    import torch

    from service.replica.kv_connector import RayObjectStoreConnector

    torch.set_num_threads(args.threads)
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="WARNING")
    try:
        actor = prefill_actor_class().remote(args.model, args.threads)
        decode = engine(args.model)
        connector = RayObjectStoreConnector()
        vocab = decode.engine.model_config.vocab_size
        rng = random.Random(7)

        def prompt() -> list[int]:
            return [rng.randrange(1, vocab - 1) for _ in range(args.prompt_tokens)]

        ray.get(actor.prefill.remote(prompt()))  # warm-up: the actor's engine and the store
        decode.generate([prompt()], ONE)
        times: dict[str, list[float]] = {k: [] for k in ("colocated", "disaggregated", "prefill", "export", "put",
                                                          "fetch", "copy in", "decode first token")}
        nbytes: list[int] = []
        for _ in range(args.rounds):
            for _ in range(args.prompts):
                p = prompt()
                t0 = time.perf_counter()
                transfer, remote = ray.get(actor.prefill.remote(p))
                t1 = time.perf_counter()
                blocks = asyncio.run(connector.receive(transfer))
                t2 = time.perf_counter()
                assert decode.engine.receive_prefix(blocks)
                loaded_s = decode.engine.incoming.load_seconds
                decode.generate([p], ONE)
                t3 = time.perf_counter()
                for k, v in remote.items():
                    times[k].append(v)
                times["fetch"].append(t2 - t1)
                times["copy in"].append(decode.engine.incoming.load_seconds - loaded_s)
                times["decode first token"].append(t3 - t2)
                times["disaggregated"].append(t3 - t0)
                nbytes.append(blocks.nbytes)
                cold = prompt()
                t4 = time.perf_counter()
                decode.generate([cold], ONE)
                times["colocated"].append(time.perf_counter() - t4)
    finally:
        ray.shutdown()
    p50 = {k: statistics.median(v) * 1000 for k, v in times.items()}
    per_1k = 1000 / args.prompt_tokens
    moved = statistics.median(nbytes)
    transfer_ms = (p50["export"] + p50["put"] + p50["fetch"] + p50["copy in"]) * per_1k
    columns = ["prompt tokens", "TTFT colocated (ms)", "TTFT disaggregated (ms)", "of which: remote prefill",
               "export", "put", "fetch", "copy in", "decode first token", "KV moved (MB)",
               "transfer per 1k tokens (ms)", "per 1k tokens (MB)"]
    rows = [[args.prompt_tokens, f"{p50['colocated']:.0f}", f"{p50['disaggregated']:.0f}", f"{p50['prefill']:.0f}",
             f"{p50['export']:.1f}", f"{p50['put']:.1f}", f"{p50['fetch']:.1f}", f"{p50['copy in']:.1f}",
             f"{p50['decode first token']:.0f}", f"{moved / 1e6:.1f}", f"{transfer_ms:.1f}",
             f"{moved / 1e6 * per_1k:.1f}"]]
    print_table(columns, rows)
    paper_columns, paper_rows = paper()
    print_table(paper_columns, paper_rows)
    if args.out:
        write_result(args.out, "bench_pd_transfer", columns, rows, note=args.note, raw={"times_s": times, "bytes": nbytes},
                     title=f"{args.model}: {args.prompt_tokens}-token prompts prefilled by a Ray actor and decoded here "
                           f"(blocks through Ray's object store) vs prefilled here; medians of "
                           f"{args.rounds} x {args.prompts} requests, one at a time (ms)",
                     tables={"paper": (paper_columns, paper_rows)})


if __name__ == "__main__":
    main()
