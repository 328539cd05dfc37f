"""The continuous-batching engine: `Engine.step()` schedules, runs the model, updates.

`sequence`, `block_manager` and `scheduler` never import torch (tests/test_layering.py checks
it); `runner` turns a scheduled batch into one forward pass and sampled tokens.
"""
