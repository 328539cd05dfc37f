"""qkv-serve's service: Ray Serve deployments and the HTTP API over the engine. Imports `model`,
never the reverse. One part per sub-package (or module), each importing only the parts below it
(tests/test_layering.py holds the table), from the bottom:
- `errors` (the API's error shape), `tools` (tool-call and reasoning parsing), `autoscaling` (the
  TTFT policy, pickled into Serve's controller) and `launch` (the serving path's Ray settings);
- `engine`: the engine in a replica's process (step loop, admission gate, metrics, model info);
- `tenancy`: API keys, tenants, quotas and their ledger; `batch` (the Files and Batch APIs over a
  directory, and the loop that runs batches) on it;
- `http`: the HTTP edge (engine calls, event streams, images, ASGI forwarding);
- `openai` on the edge, then `anthropic` and `explorer` (the attention API) on `openai`, and
  `offline` (the Ray Data processor for offline jobs, which renders chats as `openai` does);
- `server`: the FastAPI app of a replica, every API family mounted;
- `host`: the Ray-free host of one engine (`EngineHost`, `EngineStream`);
- `replica` (the Serve deployment and its placement) and `routing` (which replica serves a request);
- `app`: `build_app` and `AppArgs`, one model (`engine_app`) or several (`multi`), on top.
"""
