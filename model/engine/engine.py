"""The continuous-batching engine: `step()` = schedule -> run -> update.

Not thread-safe: one thread calls `add_request`, `abort_request` and `step`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch

from model.engine.detokenizer import IncrementalDetokenizer
from model.engine.image_step import span_embeds, span_positions
from model.engine.kv.block_manager import blocks_for
from model.engine.kv.events import KVEventBatch
from model.engine.kv.transfer import KVBlocks
from model.engine.parts import EngineParts
from model.engine.scheduler import ScheduledSeq
from model.engine.sequence import RequestOutput, RequestTimes, Sequence, TokenLogprob
from model.inspect.attention_maps import AttentionMaps, capture_attention
from model.inspect.attention_spec import check_attention
from model.multimodal.inputs import MultiModalInputs
from model.multimodal.processor import ImageInputError, ImageProcessor
from model.sampling.params import SamplingParams
from model.sampling.request_checks import check_request
from model.sampling.sampler import SamplingRow
from model.sampling.structured import GrammarConstraint

logger = logging.getLogger(__name__)

PREFILL_RATE_MIN_TOKENS = 128  # a step computing this many tokens or more measures the prefill rate
PREFILL_RATE_WEIGHT = 0.3  # the latest such step's weight in the running estimate


@dataclass(frozen=True)
class EngineStats:
    """Load figures for metrics and health."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_preemptions_total: int
    num_free_blocks: int
    num_total_blocks: int
    # Of num_running / num_waiting, the sequences at LOWEST_PRIORITY (the Batch API's requests).
    num_running_lowest: int = 0
    num_waiting_lowest: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found cached
    # Speculative decoding totals since start: proposals verified, of them accepted, and per
    # proposal position (0 = the first after the last token) how many were verified / accepted.
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_drafts_per_position: tuple[int, ...] = ()
    spec_decode_num_accepted_per_position: tuple[int, ...] = ()
    lora_adapters_loaded: int = 0  # LoRA adapters resident in a slot now
    lora_adapter_loads: int = 0  # adapters put into a slot, since start
    lora_adapter_evictions: int = 0
    lora_resident: tuple[str, ...] = ()  # the resident adapters' names (what the router prefers replicas by)
    # The prefix cache's second tier (model/engine/kv/offload.py), totals since start.
    kv_offload_saved_blocks: int = 0
    kv_offload_loaded_blocks: int = 0
    kv_offload_bytes_written: int = 0
    kv_offload_bytes_read: int = 0
    kv_offload_load_seconds: float = 0.0
    kv_offload_errors: int = 0
    kv_offload_skipped_blocks: int = 0
    # The tier shared by the engines of a node (model/engine/kv/share.py), this engine's totals.
    kv_share_saved_blocks: int = 0
    kv_share_loaded_blocks: int = 0
    kv_share_bytes_written: int = 0
    kv_share_bytes_read: int = 0
    kv_share_load_seconds: float = 0.0
    kv_share_errors: int = 0
    kv_share_skipped_blocks: int = 0
    # Vision models (model/multimodal/encoder_cache.py), totals since start: images run through the
    # encoder, images whose embeddings came from the encoder cache, time spent encoding.
    mm_images_encoded: int = 0
    mm_encoder_cache_hits: int = 0
    mm_encoder_seconds: float = 0.0


@dataclass
class _Request:
    """Engine-side state of one request beside its scheduler `Sequence`."""

    seq: Sequence
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    times: RequestTimes
    # Structured output: lives as long as the request, so preemption (which recomputes the
    # same tokens, never re-samples them) leaves it in step with output_token_ids.
    constraint: GrammarConstraint | None = None
    # params.prompt_logprobs: entry i is prompt token i + 1's, filled as prefill chunks run
    prompt_logprobs: list[TokenLogprob] | None = None


class Engine:
    """Hosts one model, its paged KV cache and the scheduler; batches every in-flight request."""

    def __init__(self, parts: EngineParts) -> None:
        """`parts` from `model.engine.builder.build_parts`; `build_engine(model, engine_config, ...)`
        makes both."""
        self.config = parts.config
        self.model_name = parts.model_name
        self.device, self.dtype, self.kv_cache_dtype = parts.device, parts.dtype, parts.kv_cache_dtype
        self.model_config, self.tokenizer, self.generation_config = (parts.model_config, parts.tokenizer,
                                                                     parts.generation_config)
        self.runner, self.scheduler, self.runtime = parts.runner, parts.scheduler, parts.runtime
        self.quant_scheme, self.head_scheme = parts.quant_scheme, parts.head_scheme
        self.int8_activations = parts.int8_activations
        self.lora = parts.lora  # LoRA adapters over this model (model/engine/lora_manager.py)
        self._lora_waiting: list[_Request] = []  # requests whose adapter waits for a free slot
        # Prefill-only forwards for /v1/embeddings, run by the step thread between steps (service/openai/embeddings.py).
        self.embedder = parts.embedder
        self.attention_shape = parts.attention_shape
        self.prefix_salt, self.kv_namespace = parts.prefix_salt, parts.kv_namespace
        self.kv_offload, self.kv_share, self.incoming = parts.kv_offload, parts.kv_share, parts.incoming
        self.structured, self.image_processor, self.spec = parts.structured, parts.image_processor, parts.spec
        self._eos_ids = frozenset(self.tokenizer.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._aborted: list[_Request] = []
        # What computing a prompt token costs here, as measured over the steps that computed at least
        # PREFILL_RATE_MIN_TOKENS tokens (None until one did): what a fetch of cached blocks from
        # another replica is weighed against (service/replica/peer_fetch.py).
        self.prefill_seconds_per_token: float | None = None
        logger.info("engine ready: %s on %s (%s), %d KV blocks of %d tokens (%s), quantization %s%s",
                    self.model_name, self.runtime.device, self.runtime.dtype, self.runtime.num_kv_blocks,
                    self.config.block_size, str(self.kv_cache_dtype).removeprefix("torch."),
                    (self.quant_scheme.describe() | {"lm_head": self.head_scheme.method if self.head_scheme else None})
                    if self.quant_scheme else "none",
                    " with int8 activations" if self.int8_activations else "")
        logger.info("start-up phases: %s", ", ".join(f"{phase} {seconds:.2f} s"
                                                     for phase, seconds in self.runtime.startup_seconds.items()))

    # ---- requests -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, lora: str | None = None, priority: int = 0,
                    tenant: str | None = None, mm: MultiModalInputs | None = None) -> None:
        """Queue a request. Raises ValueError for an id in use, a request that fails
        `model.sampling.request_checks.check_request` (a `RequestError` naming the parameter), one
        needing more KV blocks than the pool has, or a structured-output constraint that does not
        compile. Compiling is slow the first time: callers that must not stall the step call
        `self.structured.prepare([params])` on another thread first.

        `lora`: the name of a LoRA adapter to run the request under (None: the base model); a
        `LoraError` (a ValueError) for one that is unknown or does not fit. A request whose adapter
        finds every slot held by adapters in use waits (outside the scheduler) for one.

        `priority` (vLLM's): with scheduling_policy "priority", lower is handled earlier (negative
        allowed); any other value than 0 is a ValueError under "fcfs". `tenant`: whom the request is
        for (an API key, a user; None: a group of its own): a waiting request whose tenant has fewer
        running requests is admitted before a busier tenant's. `arrival_time` (time.monotonic()):
        what first come, first served and priority aging count from; None: now. `mm`: the prompt's
        images, from `process_images` (whose expanded prompt `prompt_token_ids` must be)."""
        self._validate(request_id, prompt_token_ids, params)
        if mm is not None:
            self._check_images(prompt_token_ids, mm)
        self._check_priority(priority, tenant)
        if lora is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {lora!r} asked for, but this engine serves no adapters "
                                 "(set lora_modules or lora_dynamic_path)")
            self.lora.adapter(lora)  # read and checked here, on first use, not inside a step
        constraint = self.structured.constraint(params)
        arrival = arrival_time or time.monotonic()
        seq = Sequence(request_id, list(prompt_token_ids), params, lora=lora, priority=priority, tenant=tenant,
                       arrival_time=arrival)
        if mm is not None and mm.images:
            seq.mm, seq.mm_hash_keys = mm, mm.hash_keys()
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        self._requests[request_id] = _Request(seq, IncrementalDetokenizer(self.tokenizer, params.stop), gen,
                                              RequestTimes(arrival=arrival), constraint,
                                              [] if params.prompt_logprobs is not None else None)
        if lora is None:
            self.scheduler.add(seq)
        else:
            self._lora_waiting.append(self._requests[request_id])
            self._admit_lora()

    def export_prefix(self, prompt_token_ids: list[int], lora: str | None = None) -> KVBlocks:
        """The KV blocks of the prompt's leading full blocks still cached, for another engine of the
        same model to continue from (prefill/decode disaggregation, a peer's prefix fetch): those
        in the pool, then those the offload tiers hold after them. Between steps."""
        if self.incoming is None:
            raise ValueError("exporting KV blocks needs prefix caching")
        keys, run = self.scheduler.blocks.cached_prefix(prompt_token_ids, lora)
        pool = self.incoming.pool
        parts = [pool.copy_out_many(run)]
        tiers = [t for t in (self.kv_offload, self.kv_share) if t is not None]
        for key in keys[len(run):] if tiers else ():
            block = next((b for t in tiers if (b := t.read(key)) is not None), None)
            if block is None:
                break
            parts.append(block)
        data = parts[0] if len(parts) == 1 else torch.cat(parts)  # a copy: tier buffers are reused
        return KVBlocks(keys[:len(run) + len(parts) - 1], data, pool.block_nbytes, self.kv_namespace)

    def drain_kv_events(self) -> KVEventBatch | None:
        """The prefix-cache changes of the pool and the offload tier since the last call, as one batch
        (None: none, or `enable_kv_cache_events` off). Between steps, from the step thread."""
        events = self.scheduler.blocks.events
        return None if events is None else events.drain()

    def cached_prefix_blocks(self, prompt_token_ids: list[int], lora: str | None = None) -> tuple[int, int]:
        """(leading full blocks of the prompt in the pool now, or in the tiers after the pool's run
        (loaded from there, not computed), and the full blocks it has). Reads only, so a
        caller off the step thread may ask (a decode replica deciding whether to fetch a prefill):
        the answer may be stale by the time the prompt is admitted, which costs time, not tokens."""
        blocks = self.scheduler.blocks
        if not blocks.enable_prefix_caching:
            return 0, len(prompt_token_ids) // blocks.block_size
        keys, run = blocks.cached_prefix(prompt_token_ids, lora)
        held = len(run)
        tiers = [t for t in (self.kv_offload, self.kv_share) if t is not None]
        # the run goes on with what the offload tiers hold (loaded, not computed)
        while held < len(keys) and any(t.has(keys[held]) for t in tiers):
            held += 1
        return held, len(keys)

    def receive_prefix(self, blocks: KVBlocks) -> bool:
        """Keep blocks another engine exported until the request they are for is admitted: its
        prefix then runs through them as through cached blocks. False (and nothing kept) when they
        are not for this engine's model and layout, or this engine has no prefix cache. Between steps."""
        if self.incoming is None or blocks.namespace != self.kv_namespace:
            return False
        self.incoming.add(blocks)
        return True

    def _admit_lora(self) -> None:
        """Hand the requests waiting for an adapter slot to the scheduler, in order, while slots last."""
        while self._lora_waiting:
            seq = self._lora_waiting[0].seq
            slot = self.lora.acquire(seq.lora)
            if slot is None:
                return
            seq.lora_slot = slot
            self.scheduler.add(self._lora_waiting.pop(0).seq)

    def _release_lora(self, req: _Request) -> None:
        """The request no longer holds its adapter's slot (finished or aborted)."""
        if req in self._lora_waiting:
            self._lora_waiting.remove(req)
        elif req.seq.lora_slot >= 0:
            self.lora.release(req.seq.lora)
            req.seq.lora_slot = -1

    def process_images(self, prompt_token_ids: list[int], images: list) -> tuple[list[int], MultiModalInputs]:
        """The prompt with each image placeholder expanded to its image's tokens, and the images as
        `add_request(mm=...)` takes them (model/multimodal/processor.py). ValueError for a text model or
        placeholders that do not pair with the images. Pure CPU work off the step: a server calls it
        on another thread."""
        return self._vision().process(prompt_token_ids, images)

    def _vision(self) -> ImageProcessor:
        if self.image_processor is None:
            raise ImageInputError(f"model {self.model_name!r} does not take images (it has no vision encoder)")
        return self.image_processor

    def _check_images(self, prompt: list[int], mm: MultiModalInputs) -> None:
        token = self._vision().vision.image_token_id
        covered = sum(im.length for im in mm.images)
        if any(im.end > len(prompt) or any(t != token for t in prompt[im.offset:im.end]) for im in mm.images) \
                or sum(t == token for t in prompt) != covered:
            raise ImageInputError("the images' token ranges do not match the prompt's image tokens "
                                  "(expand the prompt with process_images)")

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_request(prompt, params, self.model_config.vocab_size, self.runtime.max_model_len)
        if params.attention is not None:
            if self.runner.model is None:
                raise ValueError("attention maps are not available with tensor_parallel_size > 1")
            check_attention(params.attention, self.attention_shape, len(prompt))
        need = blocks_for(len(prompt) + params.max_tokens, self.config.block_size)
        if need > self.runtime.num_kv_blocks:
            raise ValueError(f"request needs {need} KV blocks but the pool has {self.runtime.num_kv_blocks}")

    def _check_priority(self, priority: int, tenant: str | None) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer (lower is handled earlier), got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority scheduling is not enabled: start the engine with "
                             f"scheduling_policy='priority' to use priority={priority} (with "
                             f"scheduling_policy={self.config.scheduling_policy!r} only priority 0 is allowed)")
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string or None, got {tenant!r}")

    def abort_request(self, request_id: str) -> None:
        """Drop a request (waiting or running); its blocks are free at once and the next
        `step()` reports it with finish_reason "abort". Unknown ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.finish(req.seq, "abort")
        if req.seq.lora is not None:
            self._release_lora(req)
        self._aborted.append(req)

    def check_health(self) -> None:
        """Raises `model.engine.parallel.WorkerDiedError` when a tensor-parallel worker is dead;
        nothing to check for a single-process engine."""
        if hasattr(self.runner, "check_health"):
            self.runner.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the KV tiers' writers (idempotent)."""
        runner = getattr(self, "runner", None)  # absent when __init__ failed early
        if hasattr(runner, "shutdown"):
            runner.shutdown()
        for name in ("kv_offload", "kv_share"):
            tier = getattr(self, name, None)
            if tier is not None:
                tier.close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter teardown: Ray may be gone already
            pass

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._aborted)

    def stats(self) -> EngineStats:
        bm = self.scheduler.blocks
        sp = self.spec.stats if self.spec is not None else None
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.usage,
                           self.scheduler.num_preemptions, bm.num_free, bm.num_blocks,
                           *self.scheduler.num_lowest(), bm.stats.queries, bm.stats.hits,
                           *((sp.num_draft_tokens, sp.num_accepted_tokens, tuple(sp.drafts_per_position),
                              tuple(sp.accepted_per_position)) if sp else ()),
                           **({} if self.lora is None else {
                               "lora_adapters_loaded": len(self.lora.slot_of), "lora_adapter_loads": self.lora.num_loads,
                               "lora_adapter_evictions": self.lora.num_evictions,
                               "lora_resident": tuple(self.lora.slot_of)}),
                           **self._tier_stats(), **self._encoder_stats())

    def _tier_stats(self) -> dict[str, int | float]:
        """The tiers' OffloadStats as EngineStats' kv_offload_* and kv_share_* fields (the same names, prefixed)."""
        return {f"{prefix}_{name}": value for prefix, tier in (("kv_offload", self.kv_offload), ("kv_share", self.kv_share))
                if tier is not None for name, value in asdict(tier.stats).items()}

    def _encoder_stats(self) -> dict[str, int | float]:
        cache = getattr(self.runner, "encoder_cache", None)
        if cache is None:
            return {}
        return {"mm_images_encoded": cache.misses, "mm_encoder_cache_hits": cache.hits,
                "mm_encoder_seconds": cache.encode_seconds}

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward pass over every scheduled sequence; the new tokens of each request."""
        outputs = [self._final(r, "", [], []) for r in self._aborted]
        self._aborted = []
        if self._lora_waiting:
            self._admit_lora()
        if self.spec is not None:
            self._propose()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return outputs
        now = time.monotonic()
        for s in sched.scheduled:
            times = self._requests[s.seq.request_id].times
            times.first_scheduled = times.first_scheduled or now
        sampling = [s for s in sched.scheduled if s.samples]
        rows = [self._row(s.seq) for s in sampling]
        wanted = any(s.seq.params.prompt_logprobs is not None for s in sched.scheduled)
        prompt_lps: dict[str, list[TokenLogprob]] | None = {} if wanted else None
        verifying = [s for s in sched.scheduled if s.spec]
        spec_logits: dict[str, torch.Tensor] | None = {} if verifying else None
        t0 = time.perf_counter()
        tokens, logprobs = self.runner.run(sched.scheduled, rows, prompt_lps, spec_logits)
        if sched.num_tokens >= PREFILL_RATE_MIN_TOKENS:  # a step that computes mostly prompt tokens
            per_token = (time.perf_counter() - t0) / sched.num_tokens
            self.prefill_seconds_per_token = per_token if self.prefill_seconds_per_token is None else \
                (1 - PREFILL_RATE_WEIGHT) * self.prefill_seconds_per_token + PREFILL_RATE_WEIGHT * per_token
        if prompt_lps:
            self._record_prompt_logprobs(sched.scheduled, prompt_lps)
        self.scheduler.computed(sched)
        now = time.monotonic()
        for s, tok, lp in zip(sampling, tokens, logprobs):
            outputs.append(self._append_token(s, tok, lp, now))
        if verifying:
            outputs.extend(self._verify(verifying, spec_logits, now))
        if self.spec is not None:
            for out in outputs:
                if out.finished:
                    self.spec.release(out.request_id)
        return outputs

    # ---- speculative decoding (model/engine/spec_decode/) -----------------------------

    def _propose(self) -> None:
        """Proposals for the running sequences that decode next step and may speculate; none
        at all when the batch is larger than disable_by_batch_size (verification would cost
        more than it saves, measured by loadtests/benchmarks/bench_spec_decode.py --backoff)."""
        running = self.scheduler.running
        for seq in running:
            seq.spec_token_ids = []
        if len(running) > self.spec.config.disable_by_batch_size:
            return
        want = []
        for seq in running:
            req = self._requests.get(seq.request_id)
            # Structured outputs (a grammar's state advances token by token) and attention
            # captures do not speculate; every other request can, exactly.
            if req is None or req.constraint is not None or seq.params.attention is not None \
                    or seq.num_uncomputed_tokens != 1:
                continue
            room = min(seq.params.max_tokens - len(seq.output_token_ids), self.runtime.max_model_len - seq.num_tokens) - 1
            before = self.scheduler.tokens_before_recompute(seq)
            room = room if before is None else min(room, before)
            if room >= 1:
                want.append((seq, room, req.generator))
        self.spec.propose(want)

    def _verify(self, verifying: list[ScheduledSeq], logits: dict[str, torch.Tensor], now: float) -> list[RequestOutput]:
        """Keep each speculating sequence's accepted tokens (appended one by one, so a stop
        string, stop token, EOS or max_tokens inside the run ends it where the plain engine
        would) and roll the K/V of the rejected ones back."""
        entries = [(s.seq, s.spec, logits[s.seq.request_id], self._requests[s.seq.request_id].generator)
                   for s in verifying]
        outputs = []
        for s, (toks, lps) in zip(verifying, self.spec.verify(entries, self._row)):
            outs = []
            for tok, lp in zip(toks, lps):
                outs.append(self._append_token(s, tok, lp, now))
                if s.seq.is_finished:
                    break
            if not s.seq.is_finished:
                self.scheduler.verified(s.seq, len(toks) - 1)
            outputs.append(_merge(outs))
        return outputs

    def _record_prompt_logprobs(self, scheduled: list[ScheduledSeq], got: dict[str, list[TokenLogprob]]) -> None:
        """Keep each prompt position's logprob once: a preempted sequence computes its prompt again."""
        for s in scheduled:
            lps = got.get(s.seq.request_id)
            kept = self._requests[s.seq.request_id].prompt_logprobs
            if lps is None or kept is None:
                continue
            for position, lp in enumerate(lps, start=s.seq.num_computed_tokens):
                if position == len(kept):
                    kept.append(lp)

    def _row(self, seq: Sequence, proposed: list[int] | None = None) -> SamplingRow:
        """`proposed`: speculative tokens taken as already sampled (the row of a later position)."""
        p = seq.params
        output = seq.output_token_ids + proposed if proposed else seq.output_token_ids
        suppress: list[int] = []
        if len(output) < p.min_tokens:
            suppress = list(p.stop_token_ids) + sorted(self._eos_ids)
        req = self._requests[seq.request_id]
        return SamplingRow(p, seq.prompt_token_ids, output, req.generator, suppress,
                           [req.constraint] if req.constraint is not None else [])

    def _append_token(self, s: ScheduledSeq, tok: int, lp: TokenLogprob | None, now: float) -> RequestOutput:
        seq = s.seq
        req = self._requests[seq.request_id]
        seq.output_token_ids.append(tok)
        req.times.first_token = req.times.first_token or now
        req.times.last_token = now
        p = seq.params
        reason, stop_reason, text = None, None, ""
        if req.constraint is not None and not req.constraint.accept(tok):
            logger.error("request %s: token %d breaks its grammar; ending it", seq.request_id, tok)
            reason = "stop"
        elif req.constraint is not None and req.constraint.is_terminated:
            reason = "stop"  # the structure is complete (its stop token was sampled)
        elif tok in self._eos_ids and not p.ignore_eos:
            reason = "stop"
        elif tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        else:
            text = req.detok.push(tok)
            if req.detok.stopped:
                reason, stop_reason = "stop", req.detok.stop_reason
            elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.runtime.max_model_len:
                reason = "length"
        if reason is None:
            return self._delta(req, text, [tok], [lp] if lp else [], [now])
        if not req.detok.stopped:
            text += req.detok.flush()  # text held back in case it began a stop string
        del self._requests[seq.request_id]
        self.scheduler.finish(seq, reason)
        if seq.lora is not None:
            self._release_lora(req)
        out = self._final(req, text, [tok], [lp] if lp else [], [now])
        out.stop_reason = stop_reason
        if p.attention is not None:  # the explicit recompute, for this request only
            keep = seq.num_prompt_tokens + p.attention.max_tokens
            out.attention = self._capture_attention(seq, keep)
        return out

    def _capture_attention(self, seq: Sequence, keep: int) -> AttentionMaps:
        """The explicit recompute of an attention request's first `keep` tokens, images in place."""
        model, embeds, positions = self.runner.model, None, None
        if seq.mm is not None:
            rows, parts = span_embeds(seq.mm, 0, keep, self.runner.encoder_cache, model.encode_image)
            embeds = (torch.cat(rows).to(self.device), torch.cat(parts)) if rows else None
            if self.model_config.mrope_section is not None:
                positions = span_positions(seq.mm, 0, keep).to(self.device)
        maps = capture_attention(model, self.attention_shape, seq.token_ids[:keep], seq.params.attention,
                                 self.config.block_size, embeds, positions)
        if seq.mm is not None:
            maps.images = [(im.offset, im.length, *im.grid) for im in seq.mm.images]
        return maps

    def _delta(self, req: _Request, text: str, toks: list[int], lps: list[TokenLogprob],
               token_times: list[float]) -> RequestOutput:
        seq = req.seq
        first = bool(toks) and len(seq.output_token_ids) == len(toks)  # the request's first output token
        return RequestOutput(seq.request_id, toks, text, seq.is_finished, seq.finish_reason,
                             seq.num_prompt_tokens, len(seq.output_token_ids), req.times, token_times,
                             lps if seq.params.logprobs is not None else None,
                             prompt_logprobs=req.prompt_logprobs if first else None,
                             num_cached_tokens=seq.num_cached_tokens)

    def _final(self, req: _Request, text: str, toks: list[int], lps: list[TokenLogprob],
               token_times: list[float] | None = None) -> RequestOutput:
        req.times.finished = time.monotonic()
        return self._delta(req, text, toks, lps, token_times or [])


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    """One step's deltas of one request (a speculating sequence emits several tokens) as one."""
    last = outs[-1]
    if len(outs) > 1:
        last.new_token_ids = [t for o in outs for t in o.new_token_ids]
        last.new_text = "".join(o.new_text for o in outs)
        last.token_times = [t for o in outs for t in o.token_times]
        if last.new_logprobs is not None:
            last.new_logprobs = [lp for o in outs for lp in o.new_logprobs or []]
        last.prompt_logprobs = outs[0].prompt_logprobs
    return last
