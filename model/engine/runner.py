"""Turns a scheduled batch into tensors, runs one forward pass, samples. Returns plain lists.

Attention backends (`EngineConfig.attention_backend`): `gather` (the reference), `fused` (the
C++ CPU kernel, model/layers/paged_attention.py), `flex` (FlexAttention over the paged cache,
model/layers/flex_attention.py, the CUDA kernel). The runner puts the chosen kernels in each
step's `AttnMetadata`; the model never knows which.

Decode steps run on static buffers (`DecodeGraphs`): a decode-only batch of B sequences is copied
into buffers padded to the next batch-size bucket, run, and the outputs sliced back to B rows. On
CUDA each bucket's forward is captured once in a CUDA graph and replayed (vLLM's scheme). On the
CPU the forward over the buffers is compiled (torch.compile, Inductor's C++ backend; the project's
kernels are custom ops with fake implementations, so the graph never breaks on them): one graph
for batch 1 and one with the batch dimension dynamic for every other bucket (a third above 64
rows), all compiled when the engine starts. `enforce_eager` turns the static buffers, graphs and
compilation off. Prefill runs eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model.engine.image_step import image_embeds, mrope_positions
from model.engine.scheduler import ScheduledSeq
from model.engine.sequence import Sequence, TokenLogprob
from model.layers.attention import PagedAttention
from model.layers.flex_attention import FlexPagedAttention, flex_supported
from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk
from model.layers.lora import LoraBatch, LoraState
from model.layers.moe import Experts
from model.layers.paged_attention import paged_decode_attention, paged_prefill_attention, use_fused
from model.models.transformer import Transformer
from model.multimodal.encoder_cache import EncoderCache
from model.sampling.sampler import SamplingRow, prompt_token_logprobs, sample

logger = logging.getLogger(__name__)


def choose_backend(name: str, device: torch.device, block_size: int) -> str:
    """The attention backend `name` resolves to on `device`; ValueError for one that cannot run there."""
    if name == "auto":
        if device.type == "cpu":
            return "fused" if use_fused(device) else "gather"
        # On CUDA: FlexAttention's compiled kernel over the paged cache. FlashAttention's KV-cache API
        # (flash_attn_with_kvcache) is not wired in: its paged mode needs blocks of 256 tokens. Which of
        # flex and gather + SDPA is faster on the device is to be confirmed by measurement
        # (loadtests/tools/device_check.py times both).
        return "flex" if flex_supported(device, block_size) else "gather"
    if name == "fused" and not use_fused(device):
        raise ValueError(f"attention_backend 'fused' is the CPU kernel and cannot run on {device} "
                         "(or could not be built); use auto, gather or flex")
    if name == "flex" and device.type == "cuda" and not flex_supported(device, block_size):
        raise ValueError(f"attention_backend 'flex' on CUDA needs a block_size that is a multiple of 16, "
                         f"got {block_size}")
    if name not in ("gather", "fused", "flex"):
        raise ValueError(f"attention_backend must be auto, gather, fused or flex; got {name!r}")
    return name


@dataclass
class FlatStep:
    """One step's flat batch as plain lists: what the single-device runner turns into tensors and
    what a tensor-parallel driver sends each of its workers (which turn it into the same tensors).

    Decode tokens (one per sequence) come first, then each prefill chunk contiguously."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # flat cache row of each token
    num_decode: int = 0
    decode_tables: list[list[int]] = field(default_factory=list)  # (B_d, width), padded with 0
    decode_lens: list[int] = field(default_factory=list)  # context length, the new token included
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # start, length, context, table
    rope_len: list[int] | None = None  # per row (AttnMetadata.rope_len); None: every row by position
    logit_rows: list[int] = field(default_factory=list)  # tensor parallelism: flat rows whose logits come back

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata]:
        """tokens (T,), positions (T,) and the step's metadata (kernels not set) on `device`."""
        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        meta = AttnMetadata(slot_mapping=tensor(self.slots), num_decode=self.num_decode)
        if self.num_decode:
            meta.decode_block_tables = tensor(self.decode_tables)  # (B, width)
            meta.decode_context_lens = tensor(self.decode_lens)  # (B,)
            meta.decode_max_context = max(self.decode_lens)
        for start, length, context, table in self.prefills:
            meta.prefills.append(PrefillChunk(start, length, context, tensor(table)))
        if self.rope_len is not None:
            meta.rope_len = tensor(self.rope_len)
        return tensor(self.tokens), tensor(self.positions), meta


def flatten(batch: list[ScheduledSeq], block_size: int) -> tuple[FlatStep, list[tuple[ScheduledSeq, int]], list[int]]:
    """The step's flat batch; each scheduled sequence with the flat index of its first token (in
    flat order: decode, then prefill); and the flat index of the last token of each sequence that
    samples this step (in `batch` order)."""
    decode, prefill = _split(batch)
    step = FlatStep(num_decode=len(decode))
    spans: list[tuple[ScheduledSeq, int]] = []
    last: dict[int, int] = {}  # id(ScheduledSeq) -> flat index of its last token
    for s in decode + prefill:
        start, n, table = s.seq.num_computed_tokens, s.num_new_tokens, s.seq.block_table
        ids = s.seq.token_ids + s.spec if s.spec else s.seq.token_ids  # proposals: verified after the last token
        spans.append((s, len(step.tokens)))
        step.tokens.extend(ids[start:start + n])
        step.positions.extend(range(start, start + n))
        step.slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        last[id(s)] = len(step.tokens) - 1
    if decode:
        width = max(len(s.seq.block_table) for s in decode)
        step.decode_tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decode]
        step.decode_lens = [s.seq.num_computed_tokens + 1 for s in decode]
    for s, first in spans[len(decode):]:
        step.prefills.append((first, s.num_new_tokens, s.seq.num_computed_tokens + s.num_new_tokens,
                              list(s.seq.block_table)))
    # RoPE lengths of sequences rotated as longer ones; a decode-only step needs none (such a
    # sequence decodes past that length, the same by position), so it can replay a decode graph.
    if any(s.seq.rope_len for s in prefill):
        step.rope_len = [s.seq.rope_len for s, _ in spans for _ in range(s.num_new_tokens)]
    return step, spans, [last[id(s)] for s in batch if s.samples]


def extra_logit_spans(spans: list[tuple[ScheduledSeq, int]], prompt_logprobs: dict | None, spec_logits: dict | None
                      ) -> list[tuple[Sequence, str, int, int]]:
    """The logits rows a step needs beyond its sampling rows: (seq, "spec" | "prompt", first flat
    row, count): a speculating sequence's 1 + k positions when `spec_logits` is asked for, and the
    positions of this chunk that predict a prompt token when `prompt_logprobs` is asked for and the
    sequence's params want them."""
    out = []
    for s, first in spans:
        seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
        if s.spec and spec_logits is not None:
            out.append((seq, "spec", first, n))
        stop = min(start + n, seq.num_prompt_tokens - 1)  # positions that predict a prompt token
        if prompt_logprobs is not None and seq.params.prompt_logprobs is not None and start < stop:
            out.append((seq, "prompt", first, stop - start))
    return out


def deliver_logits(seq: Sequence, kind: str, logits: torch.Tensor, prompt_logprobs: dict | None,
                   spec_logits: dict | None) -> None:
    """Put one `extra_logit_spans` entry's logits (count, vocab) where the engine reads them."""
    if kind == "spec":
        spec_logits[seq.request_id] = logits  # (1 + k, vocab)
        return
    start = seq.num_computed_tokens
    targets = seq.prompt_token_ids[start + 1:start + 1 + logits.shape[0]]
    prompt_logprobs[seq.request_id] = prompt_token_logprobs(logits, targets, seq.params.prompt_logprobs)


class ModelRunner:
    """Owns the model and its KV cache on one device.

    `enforce_eager`: as `EngineConfig.enforce_eager`. `scratch_block`: a cache block the block manager never hands out, where the padding rows of
    static decode batches write; None turns the static-buffer decode path off."""

    def __init__(self, model: Transformer, cache: KVCache, device: torch.device, attention_backend: str = "auto",
                 enforce_eager: bool | None = True, scratch_block: int | None = None, max_num_seqs: int = 1,
                 max_model_len: int = 0, encoder_cache_size: int = 8192) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = cache.block_size
        self.fused_available = use_fused(device)
        self.backend = choose_backend(attention_backend, device, cache.block_size)
        self.flex = FlexPagedAttention(cache.num_blocks, cache.block_size, device)
        self.graphs: DecodeGraphs | None = None
        self.lora: LoraState | None = None  # the engine's, when it serves LoRA adapters
        # Vision models (those with `encode_image`): image embeddings by image hash.
        vision = getattr(model, "encode_image", None) is not None
        self.encoder_cache = EncoderCache(encoder_cache_size) if vision else None
        if enforce_eager is None:
            enforce_eager = default_eager(device)
        if not enforce_eager and scratch_block is not None:
            width = max(1, -(-max_model_len // cache.block_size))
            self.graphs = DecodeGraphs(self, scratch_block, max_num_seqs, width)

    @property
    def fused_decode(self) -> bool:
        """Whether attention reads the cache through the fused CPU kernel (settable: True picks the
        fused backend, False the gather reference)."""
        return self.backend == "fused"

    @fused_decode.setter
    def fused_decode(self, on: bool) -> None:
        self.backend = "fused" if on else "gather"

    def set_kernels(self, meta: AttnMetadata) -> None:
        """Put this backend's decode and prefill kernels in `meta` (none for the gather path)."""
        if self.backend == "fused":
            meta.decode_kernel, meta.prefill_kernel = paged_decode_attention, paged_prefill_attention
        elif self.backend == "flex":
            self.flex.new_step()
            meta.decode_kernel, meta.prefill_kernel = self.flex.decode, self.flex.prefill

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata, list[int]]:
        """Flatten the batch (`flatten`): decode tokens (one per sequence) first, then prefill chunks.

        Returns tokens (T,), positions (T,), metadata, and the flat index of the last token
        of each sequence that samples this step (in `batch` order).
        """
        tokens, positions, meta, sample_idx, _ = self._prepare(batch)
        return tokens, positions, meta, sample_idx

    def _prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata, list[int],
                                                           list[tuple[ScheduledSeq, int]]]:
        flat, spans, sample_idx = flatten(batch, self.block_size)
        tokens, positions, meta = flat.tensors(self.device)
        self.set_kernels(meta)
        if self.lora is not None:  # each flat row's adapter slot (-1: the base model)
            meta.lora = LoraBatch.of([s.seq.lora_slot for s, _ in spans for _ in range(s.num_new_tokens)], self.device)
        if self.encoder_cache is not None:
            meta.mm_embeds = image_embeds(spans, self.encoder_cache, self.model.encode_image, self.device)
            if self.model.cfg.mrope_section is not None:
                meta.mrope_positions = mrope_positions(spans, tokens.shape[0], self.device)
        return tokens, positions, meta, sample_idx, spans

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], rows: list[SamplingRow],
            prompt_logprobs: dict[str, list[TokenLogprob]] | None = None,
            spec_logits: dict[str, torch.Tensor] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """One forward pass over the batch; one sampled token per sequence that `samples`
        (`rows` gives their sampling state, in `batch` order).

        Sequences whose params ask for `prompt_logprobs` also get, in `prompt_logprobs[request_id]`,
        the logprobs of the prompt tokens this chunk's positions predict (in position order).
        Speculating sequences (`ScheduledSeq.spec`) get the logits (1 + k, vocab) of each of their
        positions in `spec_logits[request_id]`, through the same per-chunk path."""
        tokens, positions, meta, sample_idx, spans = self._prepare(batch)
        with contextlib.nullcontext() if self.lora is None else self.lora.use(meta.lora):
            # LoRA rows decode eagerly: their grouping by adapter changes from step to step.
            if self.graphs is not None and prompt_logprobs is None and meta.lora is None and self.graphs.takes(meta):
                hidden = self.graphs.run(tokens, positions, meta)  # (B, d_model)
            else:
                hidden = self.model(tokens, positions, meta, self.cache)  # (T, d_model)
        for seq, kind, first, n in extra_logit_spans(spans, prompt_logprobs, spec_logits):
            deliver_logits(seq, kind, self.model.compute_logits(hidden[first:first + n]), prompt_logprobs, spec_logits)
        if not sample_idx:
            return [], []
        logits = self.model.compute_logits(hidden[sample_idx])  # (B_s, vocab)
        return sample(logits, rows)


def one_line(exc: BaseException) -> str:
    """The first line of an error's message."""
    return str(exc).splitlines()[0] if str(exc) else ""


def not_capturable(exc: RuntimeError) -> bool:
    """Whether an error raised while capturing a CUDA graph means an op cannot be captured: CUDA's
    stream-capture errors ("operation not permitted when stream is capturing", "... during
    capture", "uncaptured work in another stream", ...) and torch's own checks ("... during CUDA
    graph capture") all say so. Out of memory is not one of them, nor is any other error."""
    return not isinstance(exc, torch.cuda.OutOfMemoryError) and "captur" in str(exc).lower()


def decode_gathers(model: torch.nn.Module, backend: str) -> bool:
    """Whether a decode step of `model` on `backend` reads the cache through the gather path."""
    if backend == "gather":
        return True
    return any(not m.attn.has_kernel(getattr(m, "sinks", None) is not None)
               for m in model.modules() if isinstance(getattr(m, "attn", None), PagedAttention))


def default_eager(device: torch.device) -> bool:
    """`enforce_eager=None` on `device`: False on CUDA (CUDA graphs); on the CPU, see
    `DEFAULT_EAGER_ON_CPU`."""
    return DEFAULT_EAGER_ON_CPU if device.type == "cpu" else False


# Whether a CPU engine decodes eagerly unless `enforce_eager=False` asks for the compiled step.
DEFAULT_EAGER_ON_CPU = True


def compile_blocker(model: torch.nn.Module, backend: str) -> str | None:
    """Why the CPU decode step of `model` on `backend` is not compiled, or None when it is: the
    compiled step reads the cache through the fused kernel at the static buffers' full table
    width (only the kernel reads no further than each context), so a backend or a layer that
    gathers (additive, soft-capped or sink scores) keeps the eager step."""
    if backend != "fused":
        return f"attention backend {backend!r} gathers the cache; the compiled step needs the fused kernel"
    if decode_gathers(model, backend):
        return "a layer's attention has no fused kernel (additive, soft-capped or sink scores)"
    if any(isinstance(m, Experts) for m in model.modules()):
        return "mixture-of-experts layers group rows by expert with data-dependent sizes, which a graph cannot hold"
    return None


def own_code(fn: Callable) -> Callable:
    """`fn` (a bound method) over its own copy of the code object: torch.compile keeps its
    compiled graphs, and counts recompiles against its limit, per code object, so each engine's
    step gets its own instead of sharing one with every engine in the process."""
    func = fn.__func__
    fresh = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                               func.__closure__)
    return types.MethodType(fresh, fn.__self__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes: 1, 2, 4, then multiples of 8 (vLLM's), up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Decode-only steps on static buffers padded to a batch-size bucket; on CUDA one CUDA graph
    per bucket, captured the first time the bucket runs (after an eager warm-up) and replayed; on
    the CPU the compiled forward (`compile_blocker` says when it cannot be), else the eager one.

    Padding rows decode token 0 at position 0 into the scratch block (slot mapping and block
    table point there, context length 1), so they never touch a sequence's blocks.

    The compiled forward always reads block tables `width` columns wide (the fused kernel reads
    no further than each context length), so that a graph depends on nothing but the bucket:
    batch 1 compiles once, and the second bucket once more with the batch dimension marked
    dynamic, a graph that serves every larger bucket up to where a kernel changes paths (64 rows;
    above, a third graph). All are compiled at start-up (`warm_up`)."""

    def __init__(self, runner: ModelRunner, scratch_block: int, max_num_seqs: int, width: int) -> None:
        self.runner = runner
        self.buckets = batch_buckets(max_num_seqs)
        self.width = width  # block-table columns: blocks of the longest context
        self.scratch_block = scratch_block
        n, dev = self.buckets[-1], runner.device
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, width, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.long, device=dev)
        self.capture = dev.type == "cuda"
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, AttnMetadata]] = {}
        self._pool = None
        self.eager_reason: str | None = None  # why capture (CUDA) or compilation (CPU) is off, when it is
        self.compiled: Callable[..., torch.Tensor] | None = None  # the CPU's compiled forward
        self.num_compiles = 0  # graphs Inductor compiled for this step
        if not self.capture:
            self.eager_reason = compile_blocker(runner.model, runner.backend)
            if self.eager_reason is None:
                self.compiled = torch.compile(own_code(self._forward), backend=self._inductor, fullgraph=True)
                logger.info("decode runs compiled on static padded buffers on %s", dev)
            else:
                logger.info("decode runs eagerly on static padded buffers on %s: %s", dev, self.eager_reason)
        self.num_steps = 0  # decode steps run here, and of their rows the padding ones
        self.num_padding_rows = 0
        self.num_replays = 0

    def takes(self, meta: AttnMetadata) -> bool:
        """Whether this step runs here: decode only, within the largest bucket and the table width."""
        return (not meta.prefills and meta.capture is None and meta.mrope_positions is None
                and 0 < meta.num_decode <= self.buckets[-1]
                and meta.decode_block_tables is not None and meta.decode_block_tables.shape[1] <= self.width)

    def bucket(self, b: int) -> int:
        return next(s for s in self.buckets if s >= b)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """The decode step of `meta` through the static buffers -> hidden (B, d_model)."""
        b, bucket = meta.num_decode, self.bucket(meta.num_decode)
        self._fill(tokens, positions, meta, bucket)
        self.num_steps += 1
        self.num_padding_rows += bucket - b
        if not self.capture:
            return self._run_cpu(bucket, meta)[:b]
        if bucket not in self._graphs:
            try:
                self._capture_bucket(bucket)
            except RuntimeError as exc:
                if not not_capturable(exc):  # out of memory, a real bug: not hidden behind eager decoding
                    raise
                self.eager_reason = f"{type(exc).__name__}: {one_line(exc)}"
                logger.warning("CUDA graph capture of batch size %d failed, an op cannot be captured (%s); "
                               "decoding eagerly on static buffers from now on", bucket, self.eager_reason)
                self.capture = False
                self.num_steps -= 1
                self.num_padding_rows -= bucket - b
                return self.run(tokens, positions, meta)
        graph, out, _ = self._graphs[bucket]
        graph.replay()
        self.num_replays += 1
        return out[:b]

    def _run_cpu(self, bucket: int, meta: AttnMetadata) -> torch.Tensor:
        """The filled buffers' forward on the CPU: compiled, or eager with block tables as wide as
        this step's when compilation is off or has failed (logged once, the step goes on)."""
        if self.compiled is not None:
            inputs = (self.tokens[:bucket], self.positions[:bucket], self.slots[:bucket], self.block_tables[:bucket],
                      self.context_lens[:bucket])
            # Say which graph (torch._dynamo's marks are the API PyTorch's dynamic-shape guide gives for
            # this): dynamo's own guess depends on what compiled before in the process.
            for t in inputs:
                if bucket > 1:  # dynamic, yet free to be split where the code branches on the row count
                    torch._dynamo.maybe_mark_dynamic(t, 0)
                else:
                    torch._dynamo.mark_static(t, 0)
            try:
                return self.compiled(*inputs)
            except Exception as exc:  # noqa: BLE001 (the eager step below runs the same rows: an error of the
                # step itself is raised again there; one of compiling or of the compiled graph turns compiling off)
                self.compiled = None
                cause = getattr(exc, "inner_exception", None) or exc  # a backend's own error, not dynamo's wrapper
                self.eager_reason = f"compilation failed: {type(cause).__name__}: {one_line(cause)}"
                logger.warning("compiling the decode step failed, decoding eagerly from now on (%s)",
                               self.eager_reason)
        return self.runner.model(self.tokens[:bucket], self.positions[:bucket],
                                 self._meta(bucket, meta.decode_block_tables.shape[1], meta.decode_max_context),
                                 self.runner.cache)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor:
        """The model's decode forward over buffer rows, the function the CPU compiles."""
        meta = AttnMetadata(slot_mapping=slots, num_decode=tokens.shape[0], decode_block_tables=block_tables,
                            decode_context_lens=context_lens,
                            decode_max_context=block_tables.shape[1] * self.runner.block_size)
        self.runner.set_kernels(meta)
        return self.runner.model(tokens, positions, meta, self.runner.cache)

    def _inductor(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., object]:
        """torch.compile's backend: Inductor (its entry point, which the "inductor" backend name calls),
        counting the graphs it compiles (a test bounds them)."""
        from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415 (imported once something compiles)

        compiled = compile_fx(gm, example_inputs)  # may raise to restart the trace (then it is called again)
        self.num_compiles += 1
        return compiled

    def warm_up(self) -> None:
        """Compile the CPU step now, at start-up, rather than in the first requests' steps, on
        padding rows only: batch 1, the second bucket (a graph with a dynamic batch dimension) and
        the largest (a third graph when the kernels switch paths between them: the dense and
        quantized products take more than 64 rows another way)."""
        if self.compiled is None:
            return
        with torch.inference_mode():  # as the steps run: a graph compiled with autograd on would not serve them
            for bucket in sorted({*self.buckets[:2], self.buckets[-1]}):
                self._fill_padding(0, bucket)
                self._run_cpu(bucket, self._meta(bucket, self.width, self.width * self.runner.block_size))

    def _fill(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, bucket: int) -> None:
        """Copy the step's B rows into the buffers; rows B .. bucket - 1 become padding."""
        b, w = meta.num_decode, meta.decode_block_tables.shape[1]
        self.tokens[:b].copy_(tokens)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.block_tables[:b, :w].copy_(meta.decode_block_tables)
        self.block_tables[:b, w:].fill_(self.scratch_block)
        self.context_lens[:b].copy_(meta.decode_context_lens)
        self._fill_padding(b, bucket)

    def _fill_padding(self, b: int, bucket: int) -> None:
        """Rows b .. bucket - 1 decode into the scratch block."""
        if bucket > b:
            self.tokens[b:bucket].zero_()
            self.positions[b:bucket].zero_()
            self.slots[b:bucket].fill_(self.scratch_block * self.runner.block_size)
            self.block_tables[b:bucket].fill_(self.scratch_block)
            self.context_lens[b:bucket].fill_(1)

    def _meta(self, bucket: int, width: int, max_context: int) -> AttnMetadata:
        """A fresh metadata over the buffers' first `bucket` rows and `width` table columns."""
        meta = AttnMetadata(slot_mapping=self.slots[:bucket], num_decode=bucket,
                            decode_block_tables=self.block_tables[:bucket, :width],
                            decode_context_lens=self.context_lens[:bucket], decode_max_context=max_context)
        self.runner.set_kernels(meta)
        return meta

    def reserve_workspace(self) -> None:
        """Size the gather path's workspace for the largest bucket before the first capture, if a
        decode step reads through it (the gather backend, or layers without a kernel: additive,
        soft-capped, sinks): one grown later would free memory that the graphs captured before
        still read and write. A decode that never gathers (flex or fused, every layer with a
        kernel) reserves nothing: at a long context that workspace is max_num_seqs x the
        context's blocks, per K and V (2 x 16 GiB for Llama-3.1-8B at 131k with 64 sequences)."""
        if decode_gathers(self.runner.model, self.runner.backend):
            self.runner.cache.gather(0, self.block_tables)

    def _capture_bucket(self, bucket: int) -> None:
        """Warm up (compiles, sizes workspaces) then capture one bucket's forward. The warm-up runs
        on the step's own inputs, so the K/V it writes are the ones the replay writes again."""
        runner, full = self.runner, self.width * self.runner.block_size
        if self._pool is None:
            self.reserve_workspace()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                runner.model(self.tokens[:bucket], self.positions[:bucket], self._meta(bucket, self.width, full),
                             runner.cache)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, meta = torch.cuda.CUDAGraph(), self._meta(bucket, self.width, full)
        with torch.cuda.graph(graph, pool=self._pool):
            out = runner.model(self.tokens[:bucket], self.positions[:bucket], meta, runner.cache)
        self._graphs[bucket] = (graph, out, meta)
        logger.info("captured the decode CUDA graph of batch size %d", bucket)


def _split(batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
    """Decode sequences (one new token each), then prefill chunks: the order of the flat batch."""
    return [s for s in batch if s.num_new_tokens == 1], [s for s in batch if s.num_new_tokens != 1]
