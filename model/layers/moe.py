"""The mixture-of-experts feed-forward shared by Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss.

A router scores every expert per token and keeps the top k (each family's exact order of
softmax, top-k and renormalisation: `route`). The token -> expert assignments are then sorted
by expert, so each expert runs one matmul over all of its tokens; the weighted outputs are
scattered back to (token, slot) order and summed over each token's k slots. The loop is over
experts, never over tokens.

Expert weights are stacked, one tensor per projection for all experts, in the (out, in)
layout of `nn.Linear`: `gate_up_proj` (E, 2F, D) with the gate's rows first and the up
projection's after them, `down_proj` (E, D, F). The loader maps each checkpoint's layout
(per-expert tensors, fused, interleaved, MXFP4) onto these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig, MoEConfig
from model.layers.linear.dense import linear
from model.layers.mlp import GatedMLP


def route(logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k), expert ids (T, k) long)."""
    if moe.routing == "topk_softmax":  # gpt-oss: softmax over the k chosen logits, in their dtype
        top, ids = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top if moe.fp32_weights else top.to(logits.dtype)), ids


class Experts(nn.Module):
    """E gated MLPs with stacked weights; `forward` runs each on the tokens routed to it."""

    def __init__(self, d_model: int, moe: MoEConfig) -> None:
        super().__init__()
        e, f = moe.num_experts, moe.d_expert
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d_model))  # (E, 2F, D): gate rows, then up rows
        self.down_proj = nn.Parameter(torch.empty(e, d_model, f))  # (E, D, F)
        if moe.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * f))
            self.down_proj_bias = nn.Parameter(torch.empty(e, d_model))
        self.moe = moe
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init, per expert (random-weight benchmarks and build_model)."""
        pairs = [(self.gate_up_proj, self.gate_up_proj), (self.down_proj, self.down_proj)]
        if self.moe.expert_bias:
            pairs += [(self.gate_up_proj_bias, self.gate_up_proj), (self.down_proj_bias, self.down_proj)]
        for p, weight in pairs:
            bound = weight.shape[-1] ** -0.5  # 1 / sqrt(fan_in)
            nn.init.uniform_(p, -bound, bound)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        """(n, 2F) -> (n, F)."""
        gate, up = h.chunk(2, dim=-1)
        if self.moe.activation == "silu":
            return F.silu(gate) * up
        limit = self.moe.swiglu_limit  # gpt-oss: both halves clamped, and up shifted by one
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.moe.swiglu_alpha))

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on its tokens: x (n, D) -> (n, D)."""
        bias = self.moe.expert_bias
        h = linear(x, self.gate_up_proj[e], self.gate_up_proj_bias[e] if bias else None)  # (n, 2F)
        return linear(self._act(h), self.down_proj[e], self.down_proj_bias[e] if bias else None)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (T, D), weights and ids (T, k) -> sum over each token's k experts of weight * expert(x)."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # Refused before any host sync, so the runner's capture fails cleanly and decodes eagerly.
            raise RuntimeError("the MoE layer reads its per-expert token counts on the host, which a CUDA graph "
                               "cannot capture")
        t, k = ids.shape
        flat = ids.reshape(-1)  # (T*k,) assignment a = token * k + slot
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        xs = x[order // k]  # (T*k, D): each sorted assignment's token
        w = weights.reshape(-1)[order].unsqueeze(-1)  # (T*k, 1)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                ys[rows] = self._expert(e, xs[rows]) * w[rows]  # float32 when the weights are (Mixtral)
                start += n
        # Back to (token, slot) order and summed over the slots: one deterministic sum per token,
        # where index_add_ would add in an order CUDA's atomics do not fix.
        out = torch.empty_like(ys)
        out[order] = ys
        return out.view(t, k, -1).sum(dim=1)  # (T, D)


class SparseMoE(nn.Module):
    """Router (`gate`) + experts (+ Qwen2-MoE's shared expert behind its sigmoid gate): x (T, D) -> (T, D)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None, "SparseMoE needs cfg.moe"
        self.gate = nn.Linear(cfg.d_model, moe.num_experts, bias=moe.router_bias)
        self.experts = Experts(cfg.d_model, moe)
        if moe.shared_expert:
            self.shared_expert = GatedMLP(cfg.replace(d_ff=moe.shared_expert, mlp_bias=False))
            self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # (T, E)
        weights, ids = route(logits, self.moe)
        out = self.experts(x, weights, ids)
        if self.moe.shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
