"""Megatron-style sharding of one model over `world` ranks, and the loading of one rank's shard.

A rank runs the model of `local_config(cfg, world)` (its heads, KV heads and MLP columns) in which
`shard_modules` swaps four kinds of module:
- Q/K/V and gate/up (fc) projections are column-parallel: plain `nn.Linear`s of the local width;
- output and down (proj) projections are row-parallel (`RowParallelLinear`): a partial product, one
  all-reduce, then the bias, added once;
- the token embedding is vocabulary-parallel (`VocabParallelEmbedding`: rows of this rank's id
  range, zeros elsewhere, one all-reduce), and so is the LM head (tied or not): each rank computes
  the logits of its id range, gathered at rank 0 (`Collectives.gather_logits`).
With grouped-query attention and fewer KV heads than ranks, each rank holds the one KV head its
query heads read (replicated over the ranks that share it, as vLLM does).

Weights are read tensor by tensor, each sliced as it is read (`safetensors` slices of a checkpoint,
or one seeded tensor at a time for a preset): a rank never holds more than its shard plus one tensor.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model.config import PRESETS, ModelConfig
from model.layers.linear.dense import linear
from model.models.registry import architecture_of, build_model
from model.models.weight_map import CheckpointError

SHARDABLE_ARCHS = ("transformer", "gpt2", "llama")

Ranges = list[tuple[int, int]]  # [start, stop) intervals of one dim, concatenated in order


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """ValueError naming the field when `cfg` cannot be split over `world` ranks."""
    if cfg.arch not in SHARDABLE_ARCHS:
        raise ValueError(f"tensor_parallel_size > 1 supports the archs {', '.join(SHARDABLE_ARCHS)}; "
                         f"this model is {cfg.arch!r} (MoE, Gemma and Phi-3 are not sharded yet)")
    if cfg.n_heads % world:
        raise ValueError(f"tensor_parallel_size ({world}) must divide the number of attention heads "
                         f"(num_attention_heads = {cfg.n_heads})")
    kv = cfg.kv_heads
    if (kv >= world and kv % world) or (kv < world and world % kv):
        raise ValueError(f"tensor_parallel_size ({world}) and num_key_value_heads ({kv}) must divide one another")
    if cfg.d_ff % world:
        raise ValueError(f"tensor_parallel_size ({world}) must divide the MLP width (intermediate_size = {cfg.d_ff})")


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The shape one rank runs: n_heads / world query heads (d_head kept), its KV heads, d_ff / world."""
    changes = {"n_heads": cfg.n_heads // world, "head_dim": cfg.d_head, "d_ff": cfg.d_ff // world}
    if cfg.n_kv_heads is not None:
        changes["n_kv_heads"] = max(1, cfg.kv_heads // world)
    return cfg.replace(**changes)


def vocab_shard(vocab: int, world: int, rank: int) -> tuple[int, int, int]:
    """(first id, stop id, rows) of rank's vocabulary range; rows = ceil(vocab / world) (the last
    rank's range may be shorter: its extra rows are zeros and their logits are dropped)."""
    rows = math.ceil(vocab / world)
    return min(rank * rows, vocab), min((rank + 1) * rows, vocab), rows


def kv_heads_of(cfg: ModelConfig, world: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) that rank stores: its own slice, or with fewer KV heads than ranks the
    one its query heads read (query head h reads KV head h // (n_heads / kv_heads))."""
    kv = cfg.kv_heads
    if kv >= world:
        return rank * (kv // world), kv // world
    return rank // (world // kv), 1


class Collectives:
    """One rank's collectives over the default process group, timed: `seconds` and `calls` count
    the time spent inside them since the last `reset` (a step's communication time)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.seconds, self.calls = 0.0, 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        dist.all_reduce(x)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return x

    def gather_logits(self, local: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """local (N, rows) logits of this rank's id range -> (N, vocab) at rank 0, None elsewhere."""
        start = time.perf_counter()
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return torch.cat(parts, dim=-1)[:, :vocab] if parts is not None else None


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local W_local^T) + b: the input features are this rank's slice, the bias
    (replicated) is added once, after the sum."""

    def __init__(self, in_local: int, out_features: int, bias: bool, comm: Collectives) -> None:
        super().__init__(in_local, out_features, bias=bias)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Embedding):
    """Rows [first, stop) of the token embedding; other ids look up zeros; summed over ranks.
    `weight` (rows, d_model) is also this rank's slice of a tied LM head."""

    def __init__(self, rows: int, d_model: int, first: int, stop: int, comm: Collectives) -> None:
        super().__init__(rows, d_model)
        self.first, self.stop, self.comm = first, stop, comm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.first) | (tokens >= self.stop)
        local = (tokens - self.first).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)  # (T, d_model)
        return self.comm.all_reduce(out)


def shard_modules(model: nn.Module, cfg: ModelConfig, world: int, rank: int, comm: Collectives) -> None:
    """Swap `model` (built from `local_config(cfg, world)`, on the meta device) into rank's shard."""
    local = model.cfg
    first, stop, rows = vocab_shard(cfg.vocab_size, world, rank)
    width = local.n_heads * local.d_head  # this rank's attention output width
    if cfg.arch == "llama":
        model.embed_tokens = VocabParallelEmbedding(rows, cfg.d_model, first, stop, comm)
        if model.lm_head is not None:
            model.lm_head = nn.Linear(cfg.d_model, rows, bias=False)
        for layer in model.layers:
            layer.self_attn.o_proj = RowParallelLinear(width, cfg.d_model, cfg.out_bias, comm)
            layer.mlp.down_proj = RowParallelLinear(local.d_ff, cfg.d_model, cfg.mlp_bias, comm)
        return
    model.wte = VocabParallelEmbedding(rows, cfg.d_model, first, stop, comm)
    for block in model.blocks:
        block.attn.qkv = nn.Linear(cfg.d_model, 3 * width)  # [q | k | v] of the local heads
        block.attn.out = RowParallelLinear(width, cfg.d_model, True, comm)
        block.mlp.proj = RowParallelLinear(local.d_ff, cfg.d_model, True, comm)


def shard_ranges(name: str, cfg: ModelConfig, world: int, rank: int) -> tuple[int, Ranges] | None:
    """(dim, ranges) of the full tensor `name` (our parameter name) that rank holds; None: all of it."""
    heads = cfg.n_heads // world
    q = (rank * heads * cfg.d_head, (rank + 1) * heads * cfg.d_head)
    ff = (rank * (cfg.d_ff // world), (rank + 1) * (cfg.d_ff // world))
    kv_first, kv_count = kv_heads_of(cfg, world, rank)
    if name in ("wte.weight", "embed_tokens.weight", "lm_head.weight"):
        first, stop, _ = vocab_shard(cfg.vocab_size, world, rank)
        return 0, [(first, stop)]
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        d = cfg.n_heads * cfg.d_head
        return 0, [(part * d + q[0], part * d + q[1]) for part in range(3)]
    if name.endswith((".score.w_q", ".score.w_k", ".score.v")):  # additive attention: one slice per head
        return 0, [(rank * heads, (rank + 1) * heads)]
    if ".q_proj." in name:
        return 0, [q]
    if ".k_proj." in name or ".v_proj." in name:
        return 0, [(kv_first * cfg.d_head, (kv_first + kv_count) * cfg.d_head)]
    if name.endswith(("o_proj.weight", "attn.out.weight")):
        return 1, [q]
    if ".gate_proj." in name or ".up_proj." in name or ".mlp.fc." in name:
        return 0, [ff]
    if name.endswith(("down_proj.weight", "mlp.proj.weight")):
        return 1, [ff]
    return None


def _slice(full: torch.Tensor, plan: tuple[int, Ranges] | None) -> torch.Tensor:
    if plan is None:
        return full
    dim, ranges = plan
    return torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


@torch.no_grad()
def _put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy a rank's slice into its parameter; a vocabulary shard shorter than its rows is zero-padded."""
    if value.shape != param.shape:
        if value.shape[1:] != param.shape[1:] or value.shape[0] > param.shape[0]:
            raise CheckpointError(f"shard of {name!r} has shape {list(value.shape)}, expected {list(param.shape)}")
        param.zero_()
        param[: value.shape[0]].copy_(value)
        return
    param.copy_(value)


def build_shard(source: str, cfg: ModelConfig, world: int, rank: int, comm: Collectives,
                dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Rank's shard of the model `source` (a random preset's name or a checkpoint directory whose
    config is `cfg`), loaded tensor by tensor, in eval mode on `device` in `dtype`."""
    check_shardable(cfg, world)
    with torch.device("meta"):
        full = build_model(cfg)  # shapes (and a preset's seeded draws) only, no memory
        model = build_model(local_config(cfg, world))
        shard_modules(model, cfg, world, rank, comm)
    model = model.to(dtype=dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    if source in PRESETS:
        for name, value in full.seeded_tensors(cfg.init_seed):
            _put(params[name], _slice(value, shard_ranges(name, cfg, world, rank)), name)
    else:
        _load_checkpoint_shard(Path(source), model, full, params, world, rank)
    return model.eval()


def _load_checkpoint_shard(directory: Path, model: nn.Module, full: nn.Module, params: dict[str, torch.Tensor],
                           world: int, rank: int) -> None:
    from safetensors import safe_open

    from model.loading.weight_files import TensorIndex, weight_files

    raw = json.loads((directory / "config.json").read_text("utf-8"))
    _, spec = architecture_of(raw, str(directory / "config.json"))
    index = TensorIndex(weight_files(directory))
    names = spec.name_map(model, index)
    full_shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
    if set(names) != set(params) or any(t.load is not None for t in names.values()):
        raise CheckpointError(f"{directory}: this architecture's weights cannot be loaded sharded")
    expected = {t.name for t in names.values()}
    found = {n for n in index if not spec.skip(full.cfg, n)}
    if expected != found:
        raise CheckpointError(f"checkpoint {directory}: missing tensors {sorted(expected - found)[:10]}, "
                              f"unexpected {sorted(found - expected)[:10]}")
    with ExitStack() as stack:
        files: dict[Path, object] = {}
        for ours, t in names.items():
            stored = index.tensors[t.name]
            want = full_shapes[ours][::-1] if t.transpose else full_shapes[ours]
            if stored.shape != want:
                raise CheckpointError(f"tensor {t.name!r} has shape {list(stored.shape)}, expected {list(want)}")
            if stored.file not in files:
                files[stored.file] = stack.enter_context(safe_open(str(stored.file), framework="pt"))
            value = _read_slice(files[stored.file].get_slice(t.name), shard_ranges(ours, full.cfg, world, rank),
                                t.transpose, len(want))
            _put(params[ours], value.t() if t.transpose else value, ours)


def _read_slice(stored, plan: tuple[int, Ranges] | None, transpose: bool, ndim: int) -> torch.Tensor:
    """Only the rows/columns of `plan` (in our layout) of a safetensors slice; a Conv1D tensor
    (`transpose`) is stored (in, out), so our dim d is its dim 1 - d."""
    if plan is None:
        return stored[:]
    dim, ranges = plan
    dim = 1 - dim if transpose else dim
    parts = []
    for a, b in ranges:
        index = [slice(None)] * ndim
        index[dim] = slice(a, b)
        parts.append(stored[tuple(index)])
    return torch.cat(parts, dim=dim)
