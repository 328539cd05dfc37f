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
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import MutableMapping

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


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m service.launch <command> [args...] | --exports")
    env = apply_serving_env()
    if argv == ["--exports"]:  # shell lines; what the environment already holds wins, as above
        print("\n".join(f"export {key}={shlex.quote(value)}" for key, value in env.items()))
        return
    beside = os.path.join(os.path.dirname(sys.executable), argv[0])  # `serve` of this environment
    if os.sep not in argv[0] and os.access(beside, os.X_OK):
        os.execv(beside, [beside, *argv[1:]])
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
