"""The model's configuration: the shape and flavour of a decoder-only Transformer (`ModelConfig`
and its parts), the named presets, and the value sets that the engine's arguments share."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

AttentionKind = Literal["dot", "additive"]
Arch = Literal["transformer", "gpt2", "llama", "moe", "gpt_oss", "gemma2", "gemma3", "phi3", "qwen2_vl", "llava"]
RopeScalingKind = Literal["linear", "llama3", "yarn", "dynamic", "longrope"]
ROPE_SCALING_TYPES = get_args(RopeScalingKind)
KVCacheDtype = Literal["auto", "bfloat16", "float16", "float32"]
KV_CACHE_DTYPES = get_args(KVCacheDtype)
Quantization = Literal["none", "int8", "int4"]
QUANTIZATIONS = get_args(Quantization)
QuantizationGroupSize = Literal[32, 64, 128]
QUANTIZATION_GROUP_SIZES = get_args(QuantizationGroupSize)
QuantizationActivations = Literal["auto", "float32", "int8"]
QUANTIZATION_ACTIVATIONS = get_args(QuantizationActivations)
QuantizeLmHead = bool | Literal["auto", "int8"]
QUANTIZE_LM_HEAD = (False, True, "auto", "int8")
AttentionBackend = Literal["auto", "gather", "fused", "flex"]
ATTENTION_BACKENDS = get_args(AttentionBackend)
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES = get_args(SchedulingPolicy)

# Byte-level vocabulary: 256 byte values followed by the special tokens.
BYTE_VOCAB = 256
BYTE_EOS_ID = 256
BYTE_PAD_ID = 257
BYTE_VOCAB_SIZE = 258


@dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` / `rope_parameters` of a rotary config (model/layers/positions.py has the math):

    - `linear` divides every frequency by `factor`;
    - `llama3` divides only the low frequencies and blends the middle band (Llama 3.1);
    - `yarn` blends interpolated and original frequencies between the `beta_fast`/`beta_slow`
      rotation bounds and scales cos/sin by `attention_factor` (None: from `mscale`/`mscale_all_dim`);
    - `dynamic` (NTK) raises the base for positions past `original_max_position` (HF's
      max_position_embeddings), per position (a prompt longer than it: every position with the
      base of the prompt's length, as HF's prefill);
    - `longrope` multiplies the wavelengths by `short_factor`, or `long_factor` for positions past
      `original_max_position`, and scales cos/sin by `attention_factor` (None: from `factor`).
      A sequence longer than `original_max_position` when it arrives is rotated long throughout;
      with `recompute_past_original` (HF Phi-3's generate) one that grows past it is recomputed
      long from position 0 (model/engine/scheduler.py).
    """

    kind: RopeScalingKind
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    recompute_past_original: bool = False

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):  # lists from a config.json
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
        if self.kind not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope_scaling type {self.kind!r} is not supported; supported: "
                             f"{', '.join(ROPE_SCALING_TYPES)}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.kind == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError("longrope scaling needs short_factor and long_factor")


MoERouting = Literal["softmax_topk", "topk_softmax"]
MoEActivation = Literal["silu", "gpt_oss"]


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts feed-forward of `arch="moe"` (Mixtral, Qwen2/3-MoE, gpt-oss).

    `routing`: `softmax_topk` (Mixtral, Qwen): softmax over all experts in float32, then the
    top k, renormalised to sum 1 when `norm_topk_prob`; `topk_softmax` (gpt-oss): the top k
    logits, then a softmax over those k. `fp32_weights`: the routing weights stay float32
    (Mixtral) instead of being cast to the model's dtype (Qwen). `dense_layers`: layers
    that keep a dense SwiGLU MLP of `d_ff` (Qwen's `mlp_only_layers` and `decoder_sparse_step`).
    """

    num_experts: int
    top_k: int
    d_expert: int  # each expert's intermediate size
    routing: MoERouting = "softmax_topk"
    norm_topk_prob: bool = True
    fp32_weights: bool = False
    shared_expert: int = 0  # Qwen2-MoE: intermediate size of the always-on expert (0: none)
    dense_layers: tuple[int, ...] = ()
    router_bias: bool = False  # gpt-oss: the router and every expert have biases
    expert_bias: bool = False
    activation: MoEActivation = "silu"  # gpt_oss: clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))  # a list from our own config.json
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.d_expert < 1:
            raise ValueError(f"the experts' intermediate size must be >= 1, got {self.d_expert}")
        if self.routing not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"MoE routing must be softmax_topk or topk_softmax, got {self.routing!r}")


@dataclass(frozen=True)
class GemmaOptions:
    """What Gemma 2 and 3 add to the Llama-shaped decoder: (1 + weight) RMSNorms before and after
    each sub-layer, embeddings scaled by sqrt(d_model), GeGLU (tanh GELU), the attention scale
    query_pre_attn_scalar ** -0.5, Gemma 2's attention and final-logit soft-capping, Gemma 3's
    RoPE base of its sliding layers (`rope_local_theta`, unscaled)."""

    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None  # Gemma 3; None: every layer uses rope_theta / rope_scaling


@dataclass(frozen=True)
class VisionConfig:
    """A vision-language model's image side: its encoder tower, how the encoder's output reaches
    the decoder, and the prompt token that stands for one image's embeddings.

    `kind` names the family's tower: "qwen2_vl" (Qwen2-VL's ViT with 2-D RoPE, 2x2 patch merger,
    M-RoPE in the decoder) or "llava" (a CLIP or SigLIP tower plus LLaVA's two-layer projector)."""

    kind: str
    image_token_id: int
    hidden_size: int  # the tower's width (Qwen2-VL: embed_dim)
    depth: int  # encoder layers
    num_heads: int
    intermediate_size: int  # the tower's MLP width
    patch_size: int
    in_channels: int = 3
    image_size: int = 0  # llava: the square input side; 0: dynamic resolution (qwen2_vl)
    spatial_merge_size: int = 1  # qwen2_vl: patches merged per side into one token
    temporal_patch_size: int = 1  # qwen2_vl: frames per patch (an image is repeated to fill it)
    layer_norm_eps: float = 1e-6
    hidden_act: str = "quick_gelu"
    tower: str = "clip"  # llava: "clip" or "siglip"
    feature_layer: int = -2  # llava: the tower's hidden state fed to the projector
    feature_select: str = "default"  # llava: "default" drops CLIP's class token, "full" keeps it
    projector_act: str = "gelu"
    projector_bias: bool = True
    vision_start_token_id: int | None = None  # qwen2_vl: M-RoPE places each image after this token
    # Qwen2.5-VL's tower (RMSNorm, gated MLP): attention inside windows of this many pixels a side,
    # except in `full_attention_blocks`; 0: Qwen2-VL's (LayerNorm, plain MLP, whole frames).
    window_size: int = 0
    full_attention_blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("qwen2_vl", "llava"):
            raise ValueError(f"vision kind must be qwen2_vl or llava, got {self.kind!r}")
        object.__setattr__(self, "full_attention_blocks", tuple(self.full_attention_blocks))


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
    # Per layer "sliding_attention" or "full_attention" (HF's `layer_types`); None: every layer
    # has the sliding window when there is one (Mistral). See `layer_window`.
    layer_types: tuple[str, ...] | None = None
    partial_rotary_factor: float = 1.0  # RoPE rotates the first d_head * factor dims of each head
    gemma: GemmaOptions | None = None  # arch "gemma2" / "gemma3"
    moe: MoEConfig | None = None  # arch "moe": the experts that replace the dense MLP
    attention_sinks: bool = False  # gpt-oss: a learned logit per query head joins each softmax
    # Vision-language models (model/multimodal/): the image encoder; None: text only.
    vision: VisionConfig | None = None
    # Qwen2-VL's M-RoPE: the head's rotary half split into (temporal, height, width) sections, each
    # rotated by its own axis of the (3, T) positions; None: ordinary RoPE.
    mrope_section: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # from our own config.json
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if isinstance(self.gemma, dict):
            object.__setattr__(self, "gemma", GemmaOptions(**self.gemma))
        if isinstance(self.vision, dict):
            object.__setattr__(self, "vision", VisionConfig(**self.vision))
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.n_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        if self.arch.startswith("gemma") != (self.gemma is not None):
            raise ValueError(f"arch 'gemma2'/'gemma3' need GemmaOptions and only they take them (arch {self.arch!r})")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if (self.arch in ("moe", "gpt_oss")) != (self.moe is not None):
            raise ValueError(f"archs 'moe' and 'gpt_oss' need a MoEConfig and only they take one (arch {self.arch!r})")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.attention not in ("dot", "additive"):
            raise ValueError(f"attention must be 'dot' or 'additive', got {self.attention!r}")
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_position", "kv_heads", "d_head"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads})")
        if self.attention == "additive" and (self.arch in ("llama", "moe", "gpt_oss") or self.kv_heads != self.n_heads):
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

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (HF: it sees at most that many positions, itself
        included), or None when it attends over the whole context."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

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
    # The shape of a speculative-decoding draft for transformer-base (2 layers of d_model 256, the
    # same byte vocabulary); trained on the default model's corpus it ships as transformer-draft-trained.
    "transformer-draft-small": ModelConfig(d_model=256, n_heads=4, n_layers=2, d_ff=1024),
    # GPT-2 small shape (124M parameters), random weights: benchmarks only.
    "gpt2-small-random": ModelConfig(
        vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072,
        max_position=1024, arch="gpt2", tokenizer="byte",
    ),
}
