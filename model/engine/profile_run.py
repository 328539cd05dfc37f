"""The profiling run: the activation peak of the largest step the scheduler can form, measured on
the device before the KV cache is allocated (model/engine/memory.py takes it from the memory share)."""

from __future__ import annotations

import torch

from model.config import EngineConfig, ModelConfig
from model.engine.kv.block_manager import blocks_for
from model.engine.memory import DeviceMemory
from model.engine.runner import FlatStep, ModelRunner
from model.layers.kv_cache import KVCache


@torch.inference_mode()
def activation_peak(net: torch.nn.Module, cfg: ModelConfig, ec: EngineConfig, max_len: int, kv_dtype: torch.dtype,
                    device: torch.device, memory: DeviceMemory) -> int:
    """Bytes above the weights that one step of `max_num_batched_tokens` prompt tokens (one prefill
    chunk, the widest a step computes) and the sampler's work on `max_num_seqs` rows of logits take
    at their peak. The run writes a scratch KV cache of just its own blocks, freed after."""
    tokens = max(1, min(ec.max_num_batched_tokens, max_len))
    blocks = blocks_for(tokens, ec.block_size)
    cache = KVCache(cfg.n_layers, blocks, ec.block_size, cfg.kv_heads, cfg.d_head, kv_dtype, device)
    runner = ModelRunner(net, cache, device, ec.attention_backend, enforce_eager=True, max_num_seqs=ec.max_num_seqs,
                         max_model_len=max_len)
    step = FlatStep(tokens=[0] * tokens, positions=list(range(tokens)), slots=list(range(tokens)),
                    prefills=[(0, tokens, tokens, list(range(blocks)))])
    ids, positions, meta = step.tensors(device)
    runner.set_kernels(meta)
    memory.reset_peak()
    base = memory.allocated()
    hidden = net(ids, positions, meta, cache)
    rows = hidden[-1:].expand(min(ec.max_num_seqs, tokens), -1)  # the sampler's widest batch
    logits = net.compute_logits(rows).float()
    torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)  # top-p's sort over the vocabulary
    peak = memory.peak() - base
    del hidden, logits, cache, runner
    if device.type == "cuda":  # give the run's blocks back before the KV cache is allocated
        torch.cuda.empty_cache()
    return max(0, peak)
