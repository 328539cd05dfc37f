"""The service's Prometheus metrics, recorded through Ray's metrics pipeline.

`ray.serve.metrics` sends them to each node's metrics agent, which exports them with a `ray_`
prefix (and the deployment/replica labels), so they add up across replicas and nodes. Latencies
come from the engine's own timestamps (`RequestTimes`, `token_times`), not from the HTTP edge.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from ray.serve.metrics import Counter, Gauge, Histogram

from model.engine.sequence import RequestOutput

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0)

# Labels Ray's metrics agent adds to every metric a replica records (beside Ray's own node and
# worker ids): a dashboard may group by them.
RAY_LABELS = ("application", "deployment", "replica")


@dataclass(frozen=True)
class MetricSpec:
    """One metric: registered from here by `EngineMetrics` (as its attribute `attr`), and listed
    from here in the docs' metrics table (docs/generate.py)."""

    attr: str
    name: str  # as registered; Prometheus sees it as `exported_name(spec)`
    kind: Literal["counter", "gauge", "histogram"]
    description: str
    labels: tuple[str, ...] = ()  # besides model_name
    buckets: tuple[float, ...] = ()

    @property
    def all_labels(self) -> tuple[str, ...]:
        return ("model_name", *self.labels)

    def register(self, model_name: str) -> Counter | Gauge | Histogram:
        if self.kind == "histogram":
            metric = Histogram(self.name, self.description, list(self.buckets), self.all_labels)
        else:
            metric = (Counter if self.kind == "counter" else Gauge)(self.name, self.description, self.all_labels)
        metric.set_default_tags({"model_name": model_name})
        return metric


# The KV tiers' totals (EngineStats' kv_<tier>_* fields, model/engine/kv/offload.py's OffloadStats):
# (field, attribute suffix, help with `{tier}`).
TIER_COUNTERS = (
    ("saved_blocks", "saved", "KV blocks written to {tier}."),
    ("loaded_blocks", "loaded", "KV blocks copied back from {tier} instead of recomputed (tier hits)."),
    ("bytes_written", "written", "Bytes written to {tier}."),
    ("bytes_read", "read", "Bytes read back from {tier}."),
    ("load_seconds", "load_time", "Time the engine spent copying blocks back from {tier}."),
    ("errors", "errors", "Blocks of {tier} dropped: a write that failed (a full disk) or a read that did not "
                         "match its checksum; their tokens are recomputed."),
    ("skipped_blocks", "skipped", "KV blocks not written to {tier}: its writer was too far behind."),
)


def tier_metrics(short: str, tier: str) -> tuple[MetricSpec, ...]:
    """`qkv_kv_<short>_<field>_total` counters of one KV tier, registered as `<short>_<suffix>`."""
    return tuple(MetricSpec(f"{short}_{suffix}", f"qkv_kv_{short}_{field}_total", "counter", text.format(tier=tier))
                 for field, suffix, text in TIER_COUNTERS)


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("ttft", "qkv_time_to_first_token_seconds", "histogram",
               "Time from arrival to the first generated token.", buckets=_LATENCY_BUCKETS),
    MetricSpec("itl", "qkv_inter_token_latency_seconds", "histogram",
               "Time between two generated tokens of a request.", buckets=_ITL_BUCKETS),
    MetricSpec("e2e", "qkv_e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.",
               buckets=_E2E_BUCKETS),
    MetricSpec("queue_time", "qkv_request_queue_time_seconds", "histogram",
               "Time from arrival to first being scheduled.", buckets=_E2E_BUCKETS),
    MetricSpec("prompt_tokens", "qkv_prompt_tokens_total", "counter", "Prompt tokens of finished requests."),
    MetricSpec("generation_tokens", "qkv_generation_tokens_total", "counter", "Generated tokens."),
    MetricSpec("success", "qkv_request_success_total", "counter",
               "Finished requests by finish reason (stop, length, tool_calls, abort, embedding, ...).",
               ("finished_reason",)),
    MetricSpec("preemptions", "qkv_num_preemptions_total", "counter", "Sequences preempted to free KV blocks."),
    MetricSpec("prefix_queries", "qkv_prefix_cache_queries_total", "counter",
               "Prompt tokens looked up in the prefix cache."),
    MetricSpec("prefix_hits", "qkv_prefix_cache_hits_total", "counter",
               "Prompt tokens found in the prefix cache (their K/V not recomputed)."),
    MetricSpec("kv_events", "qkv_kv_events_total", "counter",
               "KV cache events (blocks stored, removed, cleared) this replica sent to the app's KV index "
               "(`kv_cache_index`)."),
    MetricSpec("router_pick_time", "qkv_router_pick_seconds", "histogram",
               "One request's routing decision in the prefix router: from HAProxy's question to the replica "
               "chosen, the KV index's answer included (`prefix_aware_routing`). For a multi-model app, "
               "`model_name` is the app's first model.", buckets=_LATENCY_BUCKETS),
    MetricSpec("router_index_lookup_time", "qkv_router_index_lookup_seconds", "histogram",
               "The prefix router's question to the KV index, for one request (`kv_cache_index`): until its "
               "answer, or until the router gave up on it (0.25 s).", buckets=_LATENCY_BUCKETS),
    MetricSpec("kv_index_blocks", "qkv_kv_index_blocks", "gauge",
               "Block hashes the app's KV index holds (reported by the KVIndex deployment, `kv_cache_index`)."),
    MetricSpec("kv_index_replicas", "qkv_kv_index_replicas", "gauge",
               "Engine replicas the app's KV index has heard from within its ttl (the KVIndex deployment)."),
    *tier_metrics("offload", "the offload tier"),
    *tier_metrics("share", "the shared tier (kv_share_dir)"),
    MetricSpec("remote_fetch_blocks", "qkv_kv_remote_fetch_blocks_total", "counter",
               "KV blocks this replica took from another replica's pool or offload tier instead of computing "
               "them (`kv_remote_fetch`)."),
    MetricSpec("remote_fetch_bytes", "qkv_kv_remote_fetch_bytes_total", "counter",
               "Bytes of the KV blocks fetched from other replicas."),
    MetricSpec("remote_fetch_time", "qkv_kv_remote_fetch_seconds", "histogram",
               "One prompt's fetch from another replica: from the call to the peer until the blocks are in "
               "this engine.", buckets=_LATENCY_BUCKETS),
    MetricSpec("remote_fetch_fallbacks", "qkv_kv_remote_fetch_fallbacks_total", "counter",
               "Prompts whose blocks another replica was said to hold but that were computed here instead, by "
               "reason: unavailable (the peer is gone or failed), timeout, corrupt (bytes that did not match "
               "their checksums: those blocks and the ones after them), empty (the peer no longer held them), "
               "refused (blocks of another model or layout).", ("reason",)),
    MetricSpec("remote_fetch_skipped", "qkv_kv_remote_fetch_skipped_total", "counter",
               "Long prompts this replica's pool and tiers lacked, computed here without asking another replica, "
               "by reason: none (no other replica was said to hold more of it, leaving out those avoided for 10 s "
               "after a failed fetch), index (the KV index did not answer within 0.25 s), cost (fetching was "
               "measured slower than computing).", ("reason",)),
    MetricSpec("transfers", "qkv_kv_transfers_total", "counter",
               "Long prompts of a decode replica with a Prefill deployment, by outcome: received (blocks "
               "taken), refused (blocks of another model or layout), corrupt (blocks whose bytes did not match "
               "their checksums: those and the blocks after them computed here, the others taken), failed (the "
               "prefill replica failed or timed out: prefilled here), cached (this replica's pool already held "
               "every full block: not asked).", ("outcome",)),
    MetricSpec("transfer_bytes", "qkv_kv_transfer_bytes_total", "counter",
               "Bytes of KV blocks received from the prefill deployment."),
    MetricSpec("transfer_fetch_time", "qkv_kv_transfer_fetch_seconds_total", "counter",
               "Time spent moving KV blocks from the prefill deployment (the connector's receive)."),
    MetricSpec("transfer_time", "qkv_kv_transfer_seconds", "histogram",
               "From a decode replica's call to the prefill deployment until the blocks are in its engine "
               "(the remote prefill and the transfer).", buckets=_LATENCY_BUCKETS),
    MetricSpec("mm_encoded", "qkv_mm_images_encoded_total", "counter",
               "Images run through a vision model's encoder (one found in the encoder cache is not encoded again)."),
    MetricSpec("mm_cache_hits", "qkv_mm_encoder_cache_hits_total", "counter",
               "Images whose embeddings came from the encoder cache (a prefill chunk after the first, a "
               "preempted request's recompute, the same picture in another request)."),
    MetricSpec("mm_encoder_time", "qkv_mm_encoder_seconds_total", "counter",
               "Time spent in the vision encoder, inside engine steps."),
    MetricSpec("spec_drafts", "qkv_spec_decode_num_draft_tokens_total", "counter",
               "Speculative tokens proposed and verified."),
    MetricSpec("spec_accepted", "qkv_spec_decode_num_accepted_tokens_total", "counter",
               "Speculative tokens accepted by the target model."),
    MetricSpec("spec_rate", "qkv_spec_decode_acceptance_rate_per_position", "gauge",
               "Accepted / proposed speculative tokens since start, per proposal position.", ("position",)),
    MetricSpec("running", "qkv_num_requests_running", "gauge", "Requests in the running batch."),
    MetricSpec("waiting", "qkv_num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    MetricSpec("by_priority", "qkv_num_requests_by_priority", "gauge",
               "Requests running and waiting (state), by priority class: batch (the lowest priority, 1000000, "
               "at which the Batch API's requests run) and interactive (every other); the two add up to "
               "qkv_num_requests_running and qkv_num_requests_waiting.", ("priority_class", "state")),
    MetricSpec("kv_usage", "qkv_kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (0..1)."),
    MetricSpec("kv_capacity", "qkv_kv_cache_capacity_tokens", "gauge",
               "Tokens the KV cache holds (its blocks x block_size), as sized at start-up."),
    MetricSpec("startup", "qkv_startup_seconds", "gauge",
               "Seconds each start-up phase of this replica's engine took: load (weights), profile (the "
               "profiling run, CUDA only), kv_cache (allocating the pool).", ("phase",)),
    MetricSpec("lora_loaded", "qkv_lora_adapters_loaded", "gauge", "LoRA adapters resident in this replica."),
    MetricSpec("lora_loads", "qkv_lora_adapter_loads_total", "counter", "LoRA adapters loaded into a slot."),
    MetricSpec("lora_evictions", "qkv_lora_adapter_evictions_total", "counter",
               "LoRA adapters evicted from a slot (least recently used, idle)."),
    MetricSpec("lora_requests", "qkv_lora_requests_total", "counter",
               "Finished requests (choices) run under each LoRA adapter.", ("lora_name",)),
    MetricSpec("tenant_requests", "qkv_tenant_requests_total", "counter",
               "Requests of each tenant of the keys file (`api_keys_file`; at most 256 tenants), counted before "
               "its limits are checked.", ("tenant",)),
    MetricSpec("tenant_rejections", "qkv_tenant_rejections_total", "counter",
               "Requests refused with 429 by a tenant's limit: requests_per_minute, tokens_per_minute or "
               "max_concurrency.", ("tenant", "limit")),
    MetricSpec("tenant_prompt_tokens", "qkv_tenant_prompt_tokens_total", "counter",
               "Prompt tokens of each tenant's requests (as its tokens_per_minute counts them).", ("tenant",)),
    MetricSpec("tenant_generation_tokens", "qkv_tenant_generation_tokens_total", "counter",
               "Tokens generated for each tenant, counted as they are generated.", ("tenant",)),
    MetricSpec("tenant_ttft", "qkv_tenant_time_to_first_token_seconds", "histogram",
               "Time to first token of each tenant's finished requests.", ("tenant",), _LATENCY_BUCKETS),
    MetricSpec("batches", "qkv_batches", "gauge",
               "Batches of the Batch API by status, as the replica's `batch_dir` holds them (replicas that share "
               "the directory report the same counts: take the max across them, not the sum).", ("status",)),
    MetricSpec("batch_lines", "qkv_batch_lines_total", "counter",
               "Batch requests this replica recorded, by outcome: completed (answered 200), failed (the "
               "endpoint's error), expired (not run before the batch's window ended).", ("outcome",)),
    MetricSpec("http_responses", "qkv_http_responses_total", "counter",
               "HTTP responses of the replica's edge, by route (the app's route template; unmatched paths: "
               "`other`) and status code; a stream counts once, with the status it started with. Answers "
               "HAProxy gives itself (no replica, timeouts) are in Ray Serve's `ray_serve_num_http_requests_total`.",
               ("route", "status_code")),
)


def exported_name(spec: MetricSpec) -> str:
    """The name Prometheus sees: Ray's metrics agent prefixes `ray_`."""
    return f"ray_{spec.name}"


class EngineMetrics:
    """All `qkv_*` metrics (`METRICS`) of one engine replica, each the attribute its spec names,
    labelled with the served model name."""

    def __init__(self, model_name: str) -> None:
        for spec in METRICS:
            setattr(self, spec.attr, spec.register(model_name))
        self._seen = dict.fromkeys((name for name, _ in self._totals()), 0)
        self._unreported_tokens = 0  # generated tokens observed since the last refresh
        self._spec_seen = [0, 0]  # speculative tokens proposed / accepted at the last refresh
        self._startup: dict[str, float] = {}
        self._capacity: int | None = None

    def set_startup(self, runtime: Any) -> None:
        """The engine's start-up figures (`RuntimeInfo`): exported from now on, and set again at
        every `refresh` (Ray drops a gauge that is not set for a while)."""
        self._startup = dict(runtime.startup_seconds)
        self._capacity = runtime.num_kv_blocks * runtime.block_size
        self._set_startup()

    def _set_startup(self) -> None:
        for phase, seconds in self._startup.items():
            self.startup.set(seconds, tags={"phase": phase})
        if self._capacity is not None:
            self.kv_capacity.set(self._capacity)

    def observe(self, out: RequestOutput, last_token_time: float | None) -> float | None:
        """Record one output delta; returns the time of its last token, which the caller passes
        back with the next delta of the same request for the inter-token latencies. The token
        count is added up here and reaches the counter when a request finishes or at the next
        `refresh` (a Ray counter's `inc` per delta cost 12% of this replica's serving CPU)."""
        self._unreported_tokens += len(out.new_token_ids)
        for t in out.token_times:
            if last_token_time is not None:
                self.itl.observe(max(t - last_token_time, 0.0))
            last_token_time = t
        if out.finished:
            self._observe_finished(out)
        return last_token_time

    def _flush_tokens(self) -> None:
        if self._unreported_tokens:
            self.generation_tokens.inc(self._unreported_tokens)
            self._unreported_tokens = 0

    def _observe_finished(self, out: RequestOutput) -> None:
        self._flush_tokens()  # a finished request's tokens are all counted when it is
        times = out.times
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.success.inc(1, tags={"finished_reason": out.finish_reason or "unknown"})
        if times.first_token is not None:
            self.ttft.observe(max(times.first_token - times.arrival, 0.0))
        if times.first_scheduled is not None:
            self.queue_time.observe(max(times.first_scheduled - times.arrival, 0.0))
        end = times.finished if times.finished is not None else times.last_token
        if end is not None:
            self.e2e.observe(max(end - times.arrival, 0.0))

    def observe_lora_request(self, lora: str) -> None:
        """One sequence run under LoRA adapter `lora` has finished."""
        self.lora_requests.inc(1, tags={"lora_name": lora})

    def observe_tenant_request(self, tenant: str, requests: int, prompt_tokens: int) -> None:
        """`tenant`'s requests (and their prompt tokens) since the last quota report."""
        self.tenant_requests.inc(requests, tags={"tenant": tenant})
        if prompt_tokens:
            self.tenant_prompt_tokens.inc(prompt_tokens, tags={"tenant": tenant})

    def observe_tenant_rejection(self, tenant: str, limit: str) -> None:
        self.tenant_rejections.inc(1, tags={"tenant": tenant, "limit": limit})

    def observe_tenant_tokens(self, tenant: str, n: int) -> None:
        """Tokens generated for `tenant` since the last quota report (one `inc` per report, not per token)."""
        self.tenant_generation_tokens.inc(n, tags={"tenant": tenant})

    def observe_tenant_ttft(self, tenant: str, seconds: float) -> None:
        self.tenant_ttft.observe(seconds, tags={"tenant": tenant})

    def observe_response(self, route: str, status: int) -> None:
        """The HTTP edge started a response (service/server/api.py: `ResponseCounter`)."""
        self.http_responses.inc(1, tags={"route": route, "status_code": str(status)})

    def observe_kv_events(self, count: int) -> None:
        """KV events sent to the app's KV index (service/host/engine_host.py's publisher)."""
        if count:
            self.kv_events.inc(count)

    def observe_batch_line(self, outcome: str) -> None:
        """The Batch API recorded one request's answer (service/batch/runner.py: `line_outcome`)."""
        self.batch_lines.inc(1, tags={"outcome": outcome})

    def set_batches(self, counts: dict[str, int]) -> None:
        """The batches of the replica's `batch_dir` by status (service/batch/api.py's `BatchLoop`)."""
        for status, count in counts.items():
            self.batches.set(count, tags={"status": status})

    def observe_abort(self, num_prompt_tokens: int) -> None:
        """A request whose caller went away: its final output is never read, so count it here."""
        self._flush_tokens()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.success.inc(1, tags={"finished_reason": "abort"})

    def observe_embeddings(self, num_prompt_tokens: int) -> None:
        """A finished /v1/embeddings request (its forwards run between engine steps)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.success.inc(1, tags={"finished_reason": "embedding"})

    def refresh(self, stats: object) -> None:
        """Set the gauges from an `EngineStats` snapshot and add the tokens counted since the
        last call. Called on a timer even when idle: Ray drops a gauge from its export when it
        has not been set for a while."""
        self._flush_tokens()
        self._set_startup()
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        for state, total, lowest in (("running", stats.num_running, getattr(stats, "num_running_lowest", 0)),
                                     ("waiting", stats.num_waiting, getattr(stats, "num_waiting_lowest", 0))):
            self.by_priority.set(lowest, tags={"priority_class": "batch", "state": state})
            self.by_priority.set(total - lowest, tags={"priority_class": "interactive", "state": state})
        self.kv_usage.set(stats.kv_cache_usage)
        self.lora_loaded.set(getattr(stats, "lora_adapters_loaded", 0))
        # The engine keeps running totals; the counters get what was added since the last refresh.
        for name, counter in self._totals():
            total = getattr(stats, name, 0)
            if total > self._seen[name]:
                counter.inc(total - self._seen[name])
            self._seen[name] = total
        self._refresh_spec(stats)

    def _totals(self) -> tuple[tuple[str, Counter], ...]:
        """The EngineStats running totals each counter follows."""
        return (("num_preemptions_total", self.preemptions),
                ("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits),
                ("lora_adapter_loads", self.lora_loads), ("lora_adapter_evictions", self.lora_evictions),
                ("mm_images_encoded", self.mm_encoded), ("mm_encoder_cache_hits", self.mm_cache_hits),
                ("mm_encoder_seconds", self.mm_encoder_time),
                *((f"kv_{short}_{field}", getattr(self, f"{short}_{suffix}"))
                  for short in ("offload", "share") for field, suffix, _ in TIER_COUNTERS))

    def _refresh_spec(self, stats: object) -> None:
        """Speculative decoding: the two token counters, and the acceptance rate per position."""
        drafts = getattr(stats, "spec_decode_num_draft_tokens", 0)
        accepted = getattr(stats, "spec_decode_num_accepted_tokens", 0)
        for i, (counter, total) in enumerate(((self.spec_drafts, drafts), (self.spec_accepted, accepted))):
            if total > self._spec_seen[i]:
                counter.inc(total - self._spec_seen[i])
            self._spec_seen[i] = total
        per_position = zip(getattr(stats, "spec_decode_num_drafts_per_position", ()),
                           getattr(stats, "spec_decode_num_accepted_per_position", ()))
        for pos, (d, a) in enumerate(per_position):
            if d:
                self.spec_rate.set(a / d, tags={"position": str(pos)})
