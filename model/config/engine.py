"""The engine's configuration (`EngineConfig`) and what the engine found out at start-up
(`RuntimeInfo`), never patched into the config."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from model.config.fields import described
from model.config.model import (ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_ACTIVATIONS, QUANTIZATION_GROUP_SIZES,
                                QUANTIZATIONS, QUANTIZE_LM_HEAD, SCHEDULING_POLICIES, AttentionBackend, KVCacheDtype,
                                Quantization, QuantizationActivations, QuantizeLmHead, SchedulingPolicy)
from model.config.speculative import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the continuous-batching engine (also `LLM(...)` keyword arguments, and most of
    them app arguments: `service.app.AppArgs`).

    The number of KV blocks is derived at start-up (model/engine/memory.py): from
    `kv_cache_memory_bytes` when set; else, on CUDA, from what `gpu_memory_utilization` of the
    device leaves after the weights and the profiling run's activation peak; else, on the CPU,
    `CPU_KV_CACHE_BYTES`.
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
    lowest_priority_max_seqs: int | None = described(
        None, "With scheduling_policy priority: while any request of another priority is running or waiting, "
              "at most this many sequences of the lowest priority (1000000, the Batch API's) take part in a step; "
              "the others keep their KV blocks and go on when the other requests are done, so a batch fills idle "
              "capacity without lengthening the steps of interactive requests. 0: none (a batch then waits while "
              "other requests keep coming); None: no limit.")
    block_size: int = described(16, "Tokens per KV-cache block, the unit the cache is allocated, shared (prefix "
                                    "caching) and freed in.")
    gpu_memory_utilization: float = described(
        0.9, "CUDA: the share of the GPU's total memory this engine may use for weights, activations and "
             "the KV cache (vLLM's name); the KV cache gets what remains after the weights and the peak of a "
             "profiling run at max_num_batched_tokens. In (0, 1]. Ignored on the CPU and when "
             "kv_cache_memory_bytes is set.")
    kv_cache_memory_bytes: int | None = described(
        None, "Bytes of the KV cache, set outright (vLLM's name); None: sized by gpu_memory_utilization on "
              "CUDA, 4 GiB on the CPU (the environment variable QKV_CPU_KVCACHE_SPACE, in GiB, changes that "
              "default). Never more blocks than max_num_seqs sequences of max_model_len need.")
    kv_cache_bytes: int | None = described(None, "Deprecated alias of kv_cache_memory_bytes (a warning says so).")
    num_kv_blocks: int | None = described(None, "The number of KV blocks, overriding kv_cache_memory_bytes and "
                                                "gpu_memory_utilization (mostly for tests).")
    compile_cache_dir: str | None = described(
        None, "Where compiled kernels (torch.compile's Inductor cache) are kept, shared by every engine "
              "process and replica on the machine so a warm start compiles nothing; None: "
              "~/.cache/qkv-serve/compile, unless TORCHINDUCTOR_CACHE_DIR is set.")
    max_model_len: int | None = described(None, "The longest sequence, prompt plus generated tokens; None, or "
                                                "more than the model allows: the model's max_position.")
    enable_kv_cache: bool = described(True, "False recomputes every sequence from position 0 each step: a "
                                            "baseline for benchmarks only.")
    enable_prefix_caching: bool = described(True, "Reuse the K/V of full blocks whose tokens (and all before "
                                                  "them) an earlier request computed.")
    enable_kv_cache_events: bool = described(False, "Record the prefix-cache blocks the pool and the offload tier "
                                                     "store and remove, by block hash and tier (vLLM's KV events: "
                                                     "BlockStored, BlockRemoved), "
                                                     "for `Engine.drain_kv_events` to hand on once per step. Needs "
                                                     "prefix caching.")
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
              "batch-size bucket; on CUDA each bucket is captured once in a CUDA graph and replayed; on the CPU "
              "the step is compiled with torch.compile at start-up (batch 1, one graph for every larger bucket, a "
              "third above 64 sequences) where attention reads the cache through the fused kernel, and runs eagerly "
              "otherwise. None: False on CUDA, True on the CPU (where compiling costs start-up time). Prefill "
              "always runs eagerly.")
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
              "the keys of `SpeculativeConfig` (model/config/speculative.py); None: off.")
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
        SpeculativeConfig.parse(self.speculative_config)  # ValueError naming the bad key
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.encoder_cache_size < 0:
            raise ValueError(f"encoder_cache_size must be >= 0, got {self.encoder_cache_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes is not None:
            if self.kv_cache_memory_bytes not in (None, self.kv_cache_bytes):
                raise ValueError("kv_cache_bytes is a deprecated alias of kv_cache_memory_bytes: set only "
                                 "kv_cache_memory_bytes")
            warnings.warn("kv_cache_bytes is deprecated: use kv_cache_memory_bytes", DeprecationWarning,
                          stacklevel=3)
            object.__setattr__(self, "kv_cache_memory_bytes", self.kv_cache_bytes)
            object.__setattr__(self, "kv_cache_bytes", None)
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
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
        cap = self.lowest_priority_max_seqs
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"lowest_priority_max_seqs must be an integer >= 0 or None, got {cap!r}")
        if cap is not None and self.scheduling_policy != "priority":
            raise ValueError("lowest_priority_max_seqs needs scheduling_policy 'priority' (under fcfs no request "
                             "has a priority)")

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
    kv_cache_bytes: int = 0  # the KV pool's (num_kv_blocks x the bytes of one block)
    weights_bytes: int = 0  # this process's parameters and buffers (0: in tensor-parallel workers)
    activation_peak_bytes: int = 0  # the profiling run's (CUDA); 0 where none ran
    startup_seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # phase -> seconds

    @property
    def max_concurrency(self) -> float:
        return max_concurrency(self.num_kv_blocks, self.block_size, self.max_model_len)


def max_concurrency(num_blocks: int, block_size: int, max_len: int) -> float:
    """How many sequences of `max_len` tokens `num_blocks` blocks hold at once (vLLM's start-up figure)."""
    return num_blocks / -(-max_len // block_size)
