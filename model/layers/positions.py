"""Position encodings shared by the architecture families: the paper's sinusoids and rotary
embeddings (RoPE), with the frequency scalings of HF transformers' modeling_rope_utils:
linear, llama3, yarn, dynamic (NTK) and longrope, and partial rotary dims (Phi-3/4).

Constant tables (sinusoids, rotary frequencies) are computed in float32 on the CPU and are
not buffers: `model.to(dtype)` and loading onto the meta device leave them exact.

Position-dependent scalings (`dynamic`, `longrope`) are a function of each token's position
only: HF recomputes the frequencies per forward from the longest sequence in it, so in HF's
`generate` the token at position p (p past the prompt) is rotated with the frequencies of a
sequence of p + 1 tokens, and the cached keys keep theirs; here every token is. That makes a
cached key independent of the request it came from (prefix caching, preemption and batching
stay exact), and equals HF's generate whenever the prompt itself fits in the original context
(dynamic: max_position_embeddings).
Rows may also be rotated as in a longer sequence (a per-row minimum length, AttnMetadata.rope_len):
a prompt that arrives longer than the original context is rotated throughout as HF's prefill of it
is, dynamic NTK with the base of its length and LongRoPE with the long factors; HF Phi-3's
`generate` (Phi3ForCausalLM.prepare_inputs_for_generation) also drops its cache when a sequence
first grows past that length and recomputes it all with the long factors, which the scheduler does
by recomputing such a sequence at the crossing (RopeScaling.recompute_past_original); the prefix
cache keeps blocks of each rotation apart.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.config import RopeScaling


class PerDevice:
    """A constant CPU tensor with a copy per device, made on first use."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._copies = {torch.device("cpu"): tensor}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._copies:
            self._copies[device] = self._copies[torch.device("cpu")].to(device)
        return self._copies[device]


def sinusoidal_table(max_position: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...): (max_position, d_model)."""
    cpu = torch.device("cpu")
    pos = torch.arange(max_position, dtype=torch.float64, device=cpu)[:, None]
    inv = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64, device=cpu) / d_model)
    table = torch.zeros(max_position, d_model, dtype=torch.float64, device=cpu)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv[: d_model // 2])
    return table.float()


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """(dim / 2,) float32 theta^(-2i/dim), computed as HF's default RoPE does."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies theta^(-2i/d), rescaled as `scaling` says
    (`head_dim`: the rotated dims). For `dynamic` and `longrope` these are the frequencies of
    positions within the original context."""
    inv = _default_inv_freq(head_dim, theta)
    if scaling is None or scaling.kind == "dynamic":
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if scaling.kind == "longrope":
        return _longrope_inv_freq(head_dim, theta, scaling.short_factor)
    # llama3: wavelengths longer than the original context / low_freq_factor are divided by
    # `factor`, those shorter than context / high_freq_factor kept, the band between blended.
    old = scaling.original_max_position
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    middle = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(middle, blended, scaled)


def _yarn_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those turning more than `beta_fast` times kept, a linear
    ramp over the dims between (bounds floored/ceiled unless `truncate` is False)."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _longrope_inv_freq(dim: int, theta: float, factors: tuple[float, ...] | None) -> torch.Tensor:
    """LongRoPE: each wavelength multiplied by its own factor."""
    assert factors is not None and len(factors) == dim // 2, f"longrope needs {dim // 2} factors per set"
    ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The factor cos and sin are multiplied by (HF's attention_scaling): YaRN's mscale and
    LongRoPE's sqrt(1 + log(factor) / log(original context)); 1 for the other kinds."""
    if scaling is None or scaling.kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    if scaling.kind == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_position))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim))
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer), in the rotate-half layout HF Llama uses, over the
    first `rotary_dim` dims of each head (all of them by default; Phi-3's partial rotary)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        dim = rotary_dim or head_dim
        self.dim, self.theta, self.scaling = dim, theta, scaling
        self.inv_freq = PerDevice(rope_inv_freq(dim, theta, scaling))
        self.attention_factor = rope_attention_factor(scaling)
        # longrope: positions from the original context on use the long factors.
        self.long_inv_freq = (PerDevice(_longrope_inv_freq(dim, theta, scaling.long_factor))
                              if scaling is not None and scaling.kind == "longrope" else None)

    def _inv_freq(self, positions: torch.Tensor, min_len: torch.Tensor | None = None) -> torch.Tensor:
        """(T, dim / 2) or (1, dim / 2) float32: each position's inverse frequencies (`min_len`:
        (T,) long, rows rotated as in a sequence of at least that many tokens)."""
        inv = self.inv_freq.on(positions.device)[None, :]
        scaling = self.scaling
        if scaling is None or scaling.kind not in ("dynamic", "longrope"):
            return inv
        seq_len = positions[:, None] + 1  # HF: a forward's frequencies follow max(position) + 1
        if min_len is not None:
            seq_len = torch.maximum(seq_len, min_len[:, None])
        beyond = seq_len > scaling.original_max_position
        if self.long_inv_freq is not None:
            return torch.where(beyond, self.long_inv_freq.on(positions.device)[None, :], inv)
        # dynamic NTK, as HF computes it (float32 tensors): base * (factor * L / max - (factor - 1)) ** (d / (d - 2))
        orig = scaling.original_max_position
        lens = seq_len.clamp(min=orig)
        base = self.theta * ((scaling.factor * lens / orig) - (scaling.factor - 1)) ** (self.dim / (self.dim - 2))
        exps = torch.arange(0, self.dim, 2, dtype=torch.int64, device=positions.device).float() / self.dim
        return torch.where(beyond, 1.0 / (base ** exps[None, :]), inv)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                min_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin (T, 1, rotary_dim), computed in float32 then cast; `min_len`
        (T,) long: dynamic/LongRoPE rows rotated as in a sequence of at least that many tokens."""
        freqs = positions[:, None].float() * self._inv_freq(positions, min_len)  # (T, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, d)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def mrope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, section: tuple[int, ...]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen2-VL's multimodal RoPE: positions (3, T) (temporal, height, width) -> cos, sin
        (T, 1, rotary_dim). The d/2 frequencies are cut into `section` runs, run i rotated by axis
        i % 3's position (HF's recomposition)."""
        freqs = positions[..., None].float() * self.inv_freq.on(positions.device)  # (3, T, d/2)
        freqs = torch.cat([part[i % 3] for i, part in enumerate(freqs.split(list(section), dim=-1))], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, d)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (T, H, d) rotated by its position: x cos + rotate_half(x) sin, over the first
        cos.shape[-1] dims (the rest pass through unrotated)."""
        dim = cos.shape[-1]
        if dim < x.shape[-1]:
            return torch.cat((RotaryEmbedding.apply(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
