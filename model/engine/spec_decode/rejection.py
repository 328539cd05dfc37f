"""The acceptance rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Proposal x_j drawn from q_j is kept with probability min(1, p_j(x) / q_j(x)); at the first
rejection a token is drawn from norm(max(0, p_j - q_j)) and the run ends; when all k are kept a
bonus token is drawn from p_k. Every emitted token is then distributed exactly as p. An n-gram
proposal is a point mass (q_j(x) = 1). Greedy rows keep proposals while they equal the argmax.
"""

from __future__ import annotations

import torch


def greedy_accept(argmax: list[int], proposals: list[int]) -> list[int]:
    """argmax: the target's token at each of the 1 + k positions -> the tokens emitted."""
    out: list[int] = []
    for j, x in enumerate(proposals):
        if argmax[j] != x:
            break
        out.append(x)
    out.append(argmax[len(out)])
    return out


def rejection_sample(p: torch.Tensor, proposals: list[int], q: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> list[int]:
    """p (1 + k, V): the target's sampling distribution at each position; q (k, V) the draft's,
    None for point masses at the proposals -> the tokens emitted (accepted proposals, then one
    drawn from the residual or the bonus distribution)."""
    k = len(proposals)
    out: list[int] = []
    if k:
        rows, cols = torch.arange(k, device=p.device), torch.tensor(proposals, device=p.device)
        px = p[rows, cols].tolist()
        qx = q[rows, cols].tolist() if q is not None else [1.0] * k
        us = torch.rand(k, generator=generator, device=p.device).tolist()
        for j, x in enumerate(proposals):
            if us[j] * qx[j] < px[j]:  # u < p/q, without dividing by a tiny q
                out.append(x)
                continue
            residual = (p[j] - q[j]).clamp_(min=0.0) if q is not None else p[j].clone()
            if q is None:
                residual[x] = 0.0
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had probability ~0
                residual = p[j]
            out.append(int(torch.multinomial(residual, 1, generator=generator)))
            return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out
