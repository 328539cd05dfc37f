"""Model and engine configuration: frozen dataclasses and the named presets.

Values discovered at run time (number of KV blocks, device, dtype) live in
`RuntimeInfo`, never patched into these configs. Special tokens (EOS, BOS) are the
tokenizer's (`model.loading.tokenizer`), the one place they come from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

AttentionKind = Literal["dot", "additive"]
Arch = Literal["transformer", "gpt2", "llama", "moe", "gpt_oss", "gemma2", "gemma3", "phi3", "qwen2_vl", "llava"]
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn", "dynamic", "longrope")
KVCacheDtype = Literal["auto", "bfloat16", "float16", "float32"]
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")
Quantization = Literal["none", "int8", "int4"]
QUANTIZATIONS = ("none", "int8", "int4")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
QuantizationActivations = Literal["auto", "float32", "int8"]
QUANTIZATION_ACTIVATIONS = ("auto", "float32", "int8")
QuantizeLmHead = bool | Literal["auto", "int8"]
QUANTIZE_LM_HEAD = (False, True, "auto", "int8")
AttentionBackend = Literal["auto", "gather", "fused", "flex"]
ATTENTION_BACKENDS = ("auto", "gather", "fused", "flex")
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES = ("fcfs", "priority")

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

    kind: Literal["linear", "llama3", "yarn", "dynamic", "longrope"]
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


REQUIRED: Any = dataclasses.MISSING  # the default of a `described` field that has none


def described(default: object, description: str) -> Any:
    """A dataclass field and what it means to a user: the argument reference in docs/ is generated
    from the description, and `service.app.AppArgs` takes default and description from here."""
    return dataclasses.field(default=default, metadata={"description": description})


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the continuous-batching engine (also `LLM(...)` keyword arguments, and most of
    them app arguments: `service.app.AppArgs`).

    The number of KV blocks is derived at start-up from `kv_cache_bytes`
    (or, when that is None, from `kv_cache_fraction` of free memory).
    """

    max_num_seqs: int = described(64, "The most sequences in the running batch; each step runs them all in one "
                                      "forward pass.")
    max_num_batched_tokens: int = described(2048, "Tokens one step computes at most, decodes and prompt chunks "
                                                  "together: a longer prompt is prefilled in chunks over several "
                                                  "steps.")
    scheduling_policy: SchedulingPolicy = described(
        "fcfs", "The order waiting requests are admitted in (vLLM's name and values): fcfs, first come first "
                "served; priority, by each request's `priority` (lower first, negative allowed; aged by "
                "`priority_aging_s`), and a request that does not fit preempts running ones of a worse priority. "
                "Under both, a request whose tenant has fewer running sequences goes before a busier tenant's.")
    priority_aging_s: float = described(
        10.0, "With scheduling_policy priority: a request's priority improves by 1 for every this many seconds "
              "since it arrived (preempted or not), so a low-priority request is never starved by a stream of "
              "higher ones; 0: no aging.")
    block_size: int = described(16, "Tokens per KV-cache block, the unit the cache is allocated, shared (prefix "
                                    "caching) and freed in.")
    kv_cache_bytes: int | None = described(None, "Bytes of the KV cache; None: `kv_cache_fraction` of the memory "
                                                 "free at start-up. Never more blocks than `max_num_seqs` sequences "
                                                 "of `max_model_len` need.")
    kv_cache_fraction: float = described(0.25, "Share of the free memory (the GPU's on CUDA, MemAvailable on the "
                                               "CPU) the KV cache takes when `kv_cache_bytes` is None; in (0, 0.95].")
    num_kv_blocks: int | None = described(None, "The number of KV blocks, overriding `kv_cache_bytes` and "
                                                "`kv_cache_fraction` (mostly for tests).")
    max_model_len: int | None = described(None, "The longest sequence, prompt plus generated tokens; None, or "
                                                "more than the model allows: the model's max_position.")
    enable_kv_cache: bool = described(True, "False recomputes every sequence from position 0 each step: a "
                                            "baseline for benchmarks only.")
    enable_prefix_caching: bool = described(True, "Reuse the K/V of full blocks whose tokens (and all before "
                                                  "them) an earlier request computed.")
    kv_offload_bytes: int = described(0, "Bytes of the prefix cache's second tier: cached blocks evicted from "
                                         "the pool are kept there and copied back when a prompt's prefix "
                                         "runs into them, instead of being recomputed; in host memory, or in "
                                         "a file under `kv_offload_dir`. 0: no tier. Needs prefix caching.")
    kv_offload_dir: str | None = described(None, "A directory on a local disk for the tier's file (unlinked at "
                                                 "once, so it never outlives the process); None: host memory.")
    kv_share_dir: str | None = described(None, "A directory the engines of one node share (e.g. under /dev/shm): "
                                               "each writes the prompt blocks it computes there, one file per "
                                               "block, and a prompt whose prefix another engine computed loads "
                                               "its blocks instead of recomputing them. None: no shared tier. "
                                               "Needs prefix caching and `kv_share_bytes`.")
    kv_share_bytes: int = described(0, "The size the engines keep `kv_share_dir` near (least recently used "
                                       "blocks removed first).")
    kv_cache_dtype: KVCacheDtype = described("auto", "Storage type of cached keys and values; auto: the model's "
                                                     "dtype. bfloat16/float16 halve the cache's memory (twice the "
                                                     "blocks for the same bytes) and the bytes attention reads.")
    attention_backend: AttentionBackend = described(
        "auto", "How attention reads the paged cache: `gather` (the reference: copy, then SDPA), `fused` (the C++ "
                "CPU kernel), `flex` (FlexAttention, the CUDA kernel); auto: fused on the CPU (gather if it cannot "
                "be built), flex on CUDA.")
    enforce_eager: bool | None = described(
        None, "True: decode steps run eagerly (vLLM's name). False: decode runs on static buffers padded to a "
              "batch-size bucket, each bucket captured once in a CUDA graph and replayed (on the CPU the padded "
              "path runs uncaptured). None: False on CUDA, True on the CPU. Prefill always runs eagerly.")
    quantization: Quantization = described(
        "none", "Weight-only quantization applied at load: int8 per output channel, int4 in groups of "
                "`quantization_group_size` input columns. A GPTQ/AWQ checkpoint is loaded as its config.json's "
                "`quantization_config` says, with quantization none.")
    quantization_group_size: int = described(128, "int4: input columns that share one scale (32, 64 or 128).")
    quantization_activations: QuantizationActivations = described(
        "auto", "What a quantized layer multiplies its codes with on the CPU: float32 (the format's math, "
                "activations as they are) or int8 (each block of 32 activations rounded to int8 codes, as "
                "llama.cpp's Q8_0 does, and integer dot products: AVX-512 VNNI or AVX2); auto: int8 where the "
                "kernel has an integer vector path (at most +0.01% bits/byte measured), else float32. Other "
                "devices always use float activations.")
    quantize_lm_head: QuantizeLmHead = described(
        "auto", "The LM head with on-the-fly int8/int4: true quantizes it as the other layers, int8 in int8 (one "
                "scale per row) whatever they are, false keeps it in full precision; auto: int8 on the CPU (a "
                "large vocabulary's head is most of what a decode step reads; measured at +0.03% bits/byte), "
                "full precision on other devices. A tied head's token embedding then looks rows up in the same "
                "quantized matrix (an untied embedding stays full precision).")
    speculative_config: dict | None = described(
        None, "Speculative decoding: {\"method\": \"ngram\" | \"draft_model\", \"num_speculative_tokens\": k, ...}, "
              "the keys of `SpeculativeConfig` (model/engine/spec_decode/config.py); None: off.")
    lora_modules: dict[str, str] | None = described(None, "LoRA adapters loaded at start-up, {name: directory or "
                                                          "hub id}; a request picks one by name (HTTP: its `model`; "
                                                          "`LLM.generate(lora=...)`). LoRA is on when this or "
                                                          "`lora_dynamic_path` is set.")
    lora_dynamic_path: str | None = described(None, "A directory (or hub org) under which an adapter named "
                                                    "`base:adapter` is loaded on first use.")
    max_loras: int = described(4, "Adapters resident at once per engine (least recently used evicted; adapters "
                                  "with requests in flight stay).")
    max_lora_rank: int = described(16, "The largest LoRA rank an adapter may have.")
    tensor_parallel_size: int = described(
        1, "Ray worker actors the model is sharded over (its heads, MLP columns and vocabulary; gloo on the CPU, "
           "NCCL on CUDA, one GPU each). Not with quantization, speculative_config or LoRA.")
    pipeline_parallel_size: int = described(1, "Pipeline stages: only 1 (pipeline parallelism is not "
                                               "implemented).")
    tp_worker_num_cpus: float = described(1.0, "CPUs each tensor-parallel worker actor takes.")
    encoder_cache_size: int = described(
        8192, "Vision models: image embeddings (tokens) the encoder-output cache keeps, least recently used "
              "evicted; an image in it is not encoded again (a long prefill's later chunks, a preempted "
              "request, the same image in another request).")

    def __post_init__(self) -> None:
        from model.engine.spec_decode.config import SpeculativeConfig  # noqa: PLC0415 (model.engine imports this module)

        SpeculativeConfig.parse(self.speculative_config)  # ValueError naming the bad key
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.encoder_cache_size < 0:
            raise ValueError(f"encoder_cache_size must be >= 0, got {self.encoder_cache_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        if self.quantization_activations not in QUANTIZATION_ACTIVATIONS:
            raise ValueError(f"quantization_activations must be one of {', '.join(QUANTIZATION_ACTIVATIONS)}; "
                             f"got {self.quantization_activations!r}")
        if self.quantize_lm_head not in QUANTIZE_LM_HEAD or isinstance(self.quantize_lm_head, int) \
                and not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"quantize_lm_head must be true, false, auto or int8; got {self.quantize_lm_head!r}")
        if self.quantize_lm_head in (True, "int8") and self.quantization == "none":
            raise ValueError(f"quantize_lm_head={self.quantize_lm_head} applies with quantization int8 or int4 (the head "
                             "is quantized with the layers); got quantization none")
        if self.quantization_group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of "
                             f"{', '.join(map(str, QUANTIZATION_GROUP_SIZES))}; got {self.quantization_group_size}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and {self.max_lora_rank}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                             f"got {self.attention_backend!r}")
        self._check_scheduling()
        self._check_offload()
        self._check_parallel()

    def _check_scheduling(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                             f"got {self.scheduling_policy!r}")
        if isinstance(self.priority_aging_s, bool) or not isinstance(self.priority_aging_s, (int, float)) \
                or not self.priority_aging_s >= 0:
            raise ValueError(f"priority_aging_s must be a number of seconds >= 0 (0: no aging), "
                             f"got {self.priority_aging_s!r}")

    def _check_offload(self) -> None:
        if not isinstance(self.kv_offload_bytes, int) or isinstance(self.kv_offload_bytes, bool) \
                or self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be an integer >= 0, got {self.kv_offload_bytes!r}")
        if self.kv_offload_dir is not None and self.kv_offload_bytes == 0:
            raise ValueError("kv_offload_dir needs kv_offload_bytes > 0 (the tier's size)")
        if self.kv_offload_bytes and not (self.enable_prefix_caching and self.enable_kv_cache):
            raise ValueError("kv_offload_bytes needs enable_prefix_caching (the tier keeps the prefix cache's "
                             "evicted blocks)")
        if not isinstance(self.kv_share_bytes, int) or isinstance(self.kv_share_bytes, bool) \
                or self.kv_share_bytes < 0:
            raise ValueError(f"kv_share_bytes must be an integer >= 0, got {self.kv_share_bytes!r}")
        if (self.kv_share_dir is None) != (self.kv_share_bytes == 0):
            raise ValueError("kv_share_dir and kv_share_bytes go together (the shared directory and its size); "
                             f"got kv_share_dir={self.kv_share_dir!r}, kv_share_bytes={self.kv_share_bytes}")
        if self.kv_share_dir is not None and not (self.enable_prefix_caching and self.enable_kv_cache):
            raise ValueError("kv_share_dir needs enable_prefix_caching (the shared blocks are the prefix cache's)")

    def _check_parallel(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size {self.pipeline_parallel_size!r} is not supported yet: "
                             "only 1 (use tensor_parallel_size to split a model over workers)")
        if not self.tp_worker_num_cpus > 0:
            raise ValueError(f"tp_worker_num_cpus must be > 0, got {self.tp_worker_num_cpus}")
        if self.tensor_parallel_size > 1:
            for name, off in (("quantization", self.quantization == "none"),
                              ("speculative_config", self.speculative_config is None),
                              ("kv_offload_bytes", self.kv_offload_bytes == 0),
                              ("kv_share_dir", self.kv_share_dir is None),
                              ("lora_modules", not self.lora_modules and not self.lora_dynamic_path)):
                if not off:
                    raise ValueError(f"{name} is not supported with tensor_parallel_size > 1 (got "
                                     f"tensor_parallel_size={self.tensor_parallel_size}); use one or the other")

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
    quantization: str = "none"  # what the weights hold: none, int8, int4, gptq or awq
