"""CPU per part of a running service: every process of it (the engine replica, HAProxy, the
routers, Ray's own daemons...) found by its command line, the engine replica's step thread apart,
in CPU seconds (psutil, user + system) and per generated token."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

STEP_THREAD = "qkv-step"  # service/engine/engine_loop.py names the step thread (and so its torch workers)


def service_role(cmdline: str, name: str) -> str | None:
    """Which part of the service a process is, from its command line; None: not the service's."""
    for marker, label in (("EngineDeployment", "engine replica"), ("PrefixRoute", "prefix router"),
                          ("OpenAIIngress", "ingress replica"), ("ProxyActor", "Serve proxy (Python)"),
                          ("HAProxyManager", "HAProxy manager (Python)"), ("BareEngine", None)):
        if marker in cmdline:
            return label
    if name == "haproxy" or "/haproxy " in cmdline + " ":
        return "HAProxy"
    if any(m in cmdline for m in ("gcs_server", "raylet", "ServeController", "dashboard", "log_monitor",
                                  "ray/_private", "monitor.py", "runtime_env", "default_worker")):
        return "Ray's own"
    return None


def cpu_snapshot(role: Callable[[str, str], str | None] = service_role) -> dict[tuple[int, str], float]:
    """(pid, part) -> CPU seconds so far of every process `role` names a part of the service
    (from its command line and name); the engine replica's split into "engine step" (threads
    named STEP_THREAD) and the rest."""
    out: dict[tuple[int, str], float] = {}
    me = os.getpid()
    mine = psutil.Process(me).cpu_times()
    out[(me, "benchmark clients")] = mine.user + mine.system  # this process: shown, never counted as serving
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            if p.pid == me:
                continue
            part = role(" ".join(p.info["cmdline"] or []), p.info["name"] or "")
            if part is None:
                continue
            times = p.cpu_times()
            total = times.user + times.system
            if part == "engine replica":
                step = 0.0
                for t in p.threads():
                    try:
                        comm = Path(f"/proc/{p.pid}/task/{t.id}/comm").read_text().strip()
                    except OSError:
                        continue
                    if comm == STEP_THREAD:
                        step += t.user_time + t.system_time
                out[(p.pid, "engine step")] = step
                total -= step
            out[(p.pid, part)] = total
        except (psutil.Error, OSError):
            continue
    return out


def cpu_used(before: dict[tuple[int, str], float], after: dict[tuple[int, str], float],
             tokens: int, wall: float) -> dict[str, Any]:
    """CPU seconds per part over a run, in ms per generated token and share of a core."""
    parts: dict[str, float] = {}
    for key, value in after.items():
        parts[key[1]] = parts.get(key[1], 0.0) + value - before.get(key, 0.0)
    # The token path: what a request and its tokens pass through. Serve's Python proxy is on it
    # only without HAProxy (with HAProxy it stays up as a fallback and health server); the
    # HAProxy manager only configures HAProxy.
    off_path = {"engine step", "Ray's own", "HAProxy manager (Python)", "benchmark clients"}
    if "HAProxy" in parts:
        off_path.add("Serve proxy (Python)")
    parts["serving path"] = sum(v for k, v in parts.items() if k not in off_path)
    return {name: {"cpu_s": v, "ms_per_token": 1000 * v / max(tokens, 1), "core_share": v / wall}
            for name, v in parts.items()}

