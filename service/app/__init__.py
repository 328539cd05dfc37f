"""`build_app`: the Ray Serve application builder.

    python -m service.launch serve run deploy/serve.yaml
    python -m service.launch serve run service.app:build_app model=/path/to/checkpoint max_num_seqs=32

Arguments are the fields of `AppArgs` (`args.py`); Serve validates them into it (strings from the
command line are converted). Host and port come from the Serve config (`http_options`). One model
is one engine deployment (`engine_app.py`); `models: [...]` serves several behind one endpoint
(`multi.py`, which builds each model's deployment with `engine_app`).
"""

# No `from __future__ import annotations`: Serve reads the builder's annotation as a class.

from ray import serve

from service.app.args import AppArgs, use_gpu
from service.app.engine_app import compose_app, engine_init, engine_options, ingress_settings, router_options
from service.app.multi import build_multi_model_app

__all__ = ["AppArgs", "build_app", "compose_app", "engine_init", "engine_options", "ingress_settings",
           "router_options", "use_gpu"]


def build_app(args: AppArgs) -> serve.Application:
    """The application: one model's engine deployment (with `PrefixRoute` when HAProxy picks among
    several replicas), or, with `models`, several models behind one endpoint."""
    if not isinstance(args, AppArgs):  # called directly with a dict
        args = AppArgs.model_validate(args)
    if args.models is not None:
        return build_multi_model_app(args)
    return compose_app(args)
