"""qkv-serve's service: Ray Serve deployments and the HTTP API over the engine. Imports `model`,
never the reverse. One sub-package per part, each building only on those listed before it
(tests/test_layering.py holds the order):

- `engine`: the engine in a replica's process (step loop, admission gate, metrics, model info);
- `http` with the API families `openai`, `anthropic`, `tools`: the HTTP edge each replica serves;
- `replica`: the engine replica's deployment (engine and edge in one process), and its placement;
- `routing`: which replica serves a request (prefix-aware router, HAProxy's route deployment);
- `app` (`build_app`, `AppArgs`), `multi_model` (several models behind one endpoint) and `launch`
  (the serving path's Ray settings): the application, on top.
"""
