"""Model and engine configuration: frozen dataclasses and the named presets.

Values discovered at run time (number of KV blocks, device, dtype) live in
`RuntimeInfo`, never patched into these configs. Special tokens (EOS, BOS) are the
tokenizer's (`model.loading.tokenizer`), the one place they come from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

AttentionKind = Literal["dot", "additive"]
Arch = Literal["transformer", "gpt2", "llama"]
ROPE_SCALING_TYPES = ("linear", "llama3")
KVCacheDtype = Literal["auto", "bfloat16", "float16", "float32"]
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")

# Byte-level vocabulary: 256 byte values followed by the special tokens.
BYTE_VOCAB = 256
BYTE_EOS_ID = 256
BYTE_PAD_ID = 257
BYTE_VOCAB_SIZE = 258


@dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` of a Llama-family config: `linear` divides every frequency by `factor`;
    `llama3` divides only the low frequencies and blends the middle band (Llama 3.1)."""

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope_scaling type {self.kind!r} is not supported; supported: "
                             f"{', '.join(ROPE_SCALING_TYPES)}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and flavour of a decoder-only Transformer.

    `transformer` is the paper's decoder (post-LayerNorm, sinusoidal positions,
    ReLU FFN, embeddings scaled by sqrt(d_model) and tied to the output layer);
    `gpt2` is GPT-2 (pre-LayerNorm, learned positions, GELU, tied LM head);
    `llama` is the Llama family (Llama, Mistral, Qwen2, Qwen3): pre-RMSNorm, rotary
    positions, SwiGLU, grouped-query attention, optional q/k/v biases and q/k norms.
    """

    vocab_size: int = BYTE_VOCAB_SIZE
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 6
    d_ff: int = 2048
    max_position: int = 1024
    attention: AttentionKind = "dot"
    arch: Arch = "transformer"
    layer_norm_eps: float = 1e-5
    tokenizer: Literal["byte", "hf"] = "byte"
    init_seed: int = 0
    # False drops attention's 1/sqrt(d_k): the paper's ablation, for training experiments only.
    scale_scores: bool = True
    # Llama family only (the defaults leave the paper's Transformer and GPT-2 as they are).
    n_kv_heads: int | None = None  # grouped-query attention; None: one KV head per query head
    head_dim: int | None = None  # None: d_model / n_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # Qwen2: biases on the q/k/v projections
    out_bias: bool = False  # Llama's attention_bias: also on the output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    tie_word_embeddings: bool = True
    sliding_window: int | None = None  # None: every position sees the whole context

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # from our own config.json
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.attention not in ("dot", "additive"):
            raise ValueError(f"attention must be 'dot' or 'additive', got {self.attention!r}")
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_position", "kv_heads", "d_head"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads})")
        if self.attention == "additive" and (self.arch == "llama" or self.kv_heads != self.n_heads):
            raise ValueError("additive attention is only available for the paper's Transformer and GPT-2, "
                             "without grouped-query attention")

    @property
    def d_head(self) -> int:
        """d_k = d_v: d_model / h unless the config gives head_dim (Qwen3)."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Heads of K and V, which the paged cache stores: n_heads without GQA."""
        return self.n_kv_heads or self.n_heads

    def check_context(self, max_len: int) -> None:
        """Refuse a context the model cannot attend over exactly (sliding-window attention)."""
        if self.sliding_window is not None and self.sliding_window < max_len:
            raise ValueError(
                f"this model uses sliding-window attention over {self.sliding_window} tokens, which is not "
                f"implemented; the requested context of {max_len} tokens is longer. Set max_model_len "
                f"<= {self.sliding_window}")

    @property
    def pre_norm(self) -> bool:
        return self.arch == "gpt2"

    @property
    def learned_positions(self) -> bool:
        return self.arch == "gpt2"

    @property
    def activation(self) -> str:
        return "gelu_tanh" if self.arch == "gpt2" else "relu"

    @property
    def embed_scale(self) -> float:
        # The paper multiplies the (shared) embedding weights by sqrt(d_model).
        return self.d_model**0.5 if self.arch == "transformer" else 1.0

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    # The paper's base model: d_model 512, h 8, d_k = d_v = 64, d_ff 2048, N 6.
    "transformer-base": ModelConfig(),
    "transformer-base-additive": ModelConfig(attention="additive"),
    # GPT-2 small shape (124M parameters), random weights: benchmarks only.
    "gpt2-small-random": ModelConfig(
        vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072,
        max_position=1024, arch="gpt2", tokenizer="byte",
    ),
}


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the continuous-batching engine.

    The number of KV blocks is derived at start-up from `kv_cache_bytes`
    (or, when that is None, from `kv_cache_fraction` of free memory).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float = 0.25
    num_kv_blocks: int | None = None  # explicit override, mostly for tests
    max_model_len: int | None = None  # defaults to the model's max_position
    enable_kv_cache: bool = True  # False recomputes the whole sequence each step (benchmarks only)
    # Reuse the K/V of full blocks whose tokens (and all before them) an earlier request computed.
    enable_prefix_caching: bool = True
    # Storage type of cached keys and values; "auto" is the model's dtype. bfloat16/float16 halve
    # the cache's memory (twice the blocks for the same bytes) and the bytes attention reads.
    kv_cache_dtype: KVCacheDtype = "auto"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class RuntimeInfo:
    """What the engine found out at start-up."""

    device: str
    dtype: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
