"""The continuous-batching engine: `Engine.step()` schedules, runs the model, updates.

`builder` turns an `EngineConfig` into the parts an `Engine` is constructed from (`parts`);
`sequence`, `scheduler` and the KV tiers' `kv.block_manager` never import torch
(tests/test_layering.py checks it); `runner` turns a scheduled batch into one forward pass and
sampled tokens; `kv` holds the cache's tiers (offload, shared, transferred blocks), `spec_decode`
speculative decoding, `parallel` tensor parallelism over Ray actors.
"""
