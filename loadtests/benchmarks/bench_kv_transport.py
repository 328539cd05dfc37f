"""How a prompt's KV blocks should travel between replicas on different nodes: Ray's object store
(what the service uses for prefill/decode transfers and cross-node prefix fetch,
service/replica/kv_connector.py) against Ray Direct Transport over GLOO (`tensor_transport="gloo"`,
Ray's CPU tensor transport), measured in one run on a head and two workers started with
`ray start` on loopback (tests/support/ray_nodes.py), no Serve.

A sender actor on worker a stands for the replica that holds the blocks, a receiver actor on
worker b for the one that takes them. Each round, for each payload size (the blocks of N tokens
of GPT-2 small in float32: 73,728 bytes a token), the sender copies the payload out of a
preallocated buffer (as an export copies out of the pool) and returns it; the receiver gets it
and returns its CRC32, which the driver checks against the sender's. The time is the driver's,
from the call until the receiver's answer: the move plus two actor calls, the same overhead for
both transports. The phases of one object-store move are timed where they run as well: the
sender's copy and `ray.put`, and the receiver's `ray.get` of the reference.

    .venv/bin/python loadtests/benchmarks/bench_kv_transport.py [--rounds 8] \
        [--tokens 256 1000] [--out docs/results/bench_kv_transport.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

BASE_PORT = 19100  # the cluster's ports: 19100-19259 (tests/support/ray_nodes.py)
BYTES_PER_TOKEN = 12 * 2 * 768 * 4  # GPT-2 small: 12 layers x (K, V) x 768 x float32
WAYS = ("object store", "RDT over GLOO")


def make_actors(ray: Any) -> tuple[type, type]:
    """The sender and receiver classes, each method under both transports."""
    import torch

    class Sender:
        def __init__(self, nbytes: int) -> None:
            self.buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)

        def crc(self, n: int) -> int:
            return zlib.crc32(self.buffer[:n].numpy())

        def export_store(self, n: int) -> torch.Tensor:
            return self.buffer[:n].clone()

        @ray.method(tensor_transport="gloo")
        def export_gloo(self, n: int) -> torch.Tensor:
            return self.buffer[:n].clone()

        def put(self, n: int) -> tuple[list[Any], float, float]:
            """The object-store move's first half, timed here: the copy out, then `ray.put`."""
            t0 = time.perf_counter()
            data = self.buffer[:n].clone()
            t1 = time.perf_counter()
            ref = ray.put(data)
            return [ref], t1 - t0, time.perf_counter() - t1

    class Receiver:
        def take(self, data: torch.Tensor) -> int:
            return zlib.crc32(data.numpy())

        @ray.method(tensor_transport="gloo")
        def unused(self) -> torch.Tensor:
            """Never called: an actor gets the thread RDT receives on only with a method like this
            (without one, a receive waits behind the task that waits for it, until RDT's timeout)."""
            return torch.zeros(1)

        def get(self, refs: list[Any]) -> tuple[int, float]:
            """The second half, timed here: `ray.get` of the sender's object from its node."""
            t0 = time.perf_counter()
            data = ray.get(refs[0])
            took = time.perf_counter() - t0
            return zlib.crc32(data.numpy()), took

    return Sender, Receiver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1000])
    add_result_args(ap, None)
    args = ap.parse_args()

    # This process joins the cluster as a driver: Ray reads the auth mode when it is imported (the
    # cluster's token is read at ray.init, below).
    os.environ["RAY_AUTH_MODE"] = "token"
    from tests.support.ray_nodes import RayNodes

    nodes = RayNodes(BASE_PORT)
    try:
        nodes.add("head", {"qkv_head": 1}, num_cpus=1, head=True)
        nodes.add("a", {"node_a": 1}, num_cpus=2)
        nodes.add("b", {"node_b": 1}, num_cpus=2)
        times, split = measure(nodes, args)
    finally:
        import ray

        ray.shutdown()
        nodes.stop()
    columns = ["tokens", "MB", "object store (ms)", "RDT over GLOO (ms)", "object store / RDT",
               "object store GB/s", "RDT GB/s"]
    rows, phase_rows = [], []
    for tokens in args.tokens:
        n = tokens * BYTES_PER_TOKEN
        store, gloo = (statistics.median(times[f"{tokens} {how}"]) for how in WAYS)
        rows.append([tokens, f"{n / 1e6:.1f}", f"{store * 1000:.0f}", f"{gloo * 1000:.0f}", f"{store / gloo:.2f}x",
                     f"{n / store / 1e9:.2f}", f"{n / gloo / 1e9:.2f}"])
        copy_s, put_s, get_s = (statistics.median(s[i] for s in split[str(tokens)]) for i in range(3))
        phase_rows.append([tokens, f"{copy_s * 1000:.1f}", f"{put_s * 1000:.1f}", f"{get_s * 1000:.1f}"])
    phase_columns = ["tokens", "copy out (ms)", "ray.put (ms)", "ray.get on the other node (ms)"]
    print_table(columns, rows)
    print_table(phase_columns, phase_rows)
    if args.out:
        write_result(args.out, "bench_kv_transport", columns, rows,
                     raw={"times_s": times, "object_store_phases_s": split,
                          "settings": {k: v for k, v in vars(args).items() if k not in ("out", "note", "allow_dirty")}},
                     note=args.note, tables={"phases": (phase_columns, phase_rows)},
                     title="KV blocks between actors on two Ray nodes on loopback: Ray's object store vs Ray "
                           "Direct Transport over GLOO; medians, one move at a time, each checked by CRC32")


def measure(nodes: Any, args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, list[tuple]]]:
    """Seconds per move by "<tokens> <transport>", and the object store's phases by tokens."""
    import ray
    from ray.experimental.collective import create_collective_group

    # A driver of the token-auth cluster: its token, and loopback as its own address (Ray would
    # otherwise pick the machine's first interface, where no raylet of these nodes is).
    os.environ["RAY_AUTH_TOKEN"] = nodes.token
    ray.init(address=f"127.0.0.1:{nodes.gcs_port}", _node_ip_address="127.0.0.1", log_to_driver=False)
    Sender, Receiver = make_actors(ray)
    largest = max(args.tokens) * BYTES_PER_TOKEN
    sender = ray.remote(resources={"node_a": 1}, num_cpus=1)(Sender).remote(largest)
    receiver = ray.remote(resources={"node_b": 1}, num_cpus=1)(Receiver).remote()
    create_collective_group([sender, receiver], backend="torch_gloo")

    def one(n: int, how: str) -> float:
        t0 = time.perf_counter()
        export = sender.export_store if how == WAYS[0] else sender.export_gloo
        crc = ray.get(receiver.take.remote(export.remote(n)), timeout=120)
        took = time.perf_counter() - t0
        assert crc == expected[n], f"{how}: the bytes changed on the way ({n} bytes)"
        return took

    sizes = [t * BYTES_PER_TOKEN for t in args.tokens]
    expected = {n: ray.get(sender.crc.remote(n)) for n in sizes}
    times: dict[tuple[int, str], list[float]] = {(n, how): [] for n in sizes for how in WAYS}
    split: dict[int, list[tuple[float, float, float]]] = {n: [] for n in sizes}
    for n in sizes:  # warm-up: the first move of each kind sets up its connections
        for how in WAYS:
            one(n, how)
    for r in range(args.rounds):
        for n in sizes:
            order = WAYS if r % 2 == 0 else WAYS[::-1]
            for how in order:
                times[n, how].append(one(n, how))
            refs, copy_s, put_s = ray.get(sender.put.remote(n))
            crc, get_s = ray.get(receiver.get.remote(refs))
            assert crc == expected[n]
            split[n].append((copy_s, put_s, get_s))
    return ({f"{t} {how}": times[t * BYTES_PER_TOKEN, how] for t in args.tokens for how in WAYS},
            {str(t): split[t * BYTES_PER_TOKEN] for t in args.tokens})


if __name__ == "__main__":
    main()
