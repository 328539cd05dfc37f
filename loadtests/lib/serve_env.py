"""Ray Serve's settings, which it reads when it is imported: a script that starts Ray Serve applies
them first, before `import ray`."""

from __future__ import annotations

import os


def apply_serving_env(argv: list[str]) -> dict[str, str]:
    """Set the command line's `--env KEY=VALUE ...` pairs in the environment, then the serving
    defaults (`service.launch.SERVING_ENV`: HAProxy in front of the engine replica) where they are
    not set; the RAY_SERVE_ settings now in effect."""
    try:
        from service.launch import apply_serving_env as apply_defaults
    except ImportError:  # a checkout from before the serving path had its settings
        apply_defaults = None
    for i, arg in enumerate(argv):
        if arg == "--env":
            for pair in argv[i + 1:]:
                if pair.startswith("--"):
                    break
                key, _, value = pair.partition("=")
                os.environ[key] = value
    if apply_defaults is not None:
        apply_defaults()
    return {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}
