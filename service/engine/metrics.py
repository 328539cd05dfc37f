"""The service's Prometheus metrics, recorded through Ray's metrics pipeline.

`ray.serve.metrics` sends them to each node's metrics agent, which exports them with a `ray_`
prefix (and the deployment/replica labels), so they add up across replicas and nodes. Latencies
come from the engine's own timestamps (`RequestTimes`, `token_times`), not from the HTTP edge.
"""

from __future__ import annotations

import logging

from ray.serve.metrics import Counter, Gauge, Histogram

from model.engine.sequence import RequestOutput

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0]
_E2E_BUCKETS = [0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0]

_MODEL = ("model_name",)


class EngineMetrics:
    """All `qkv_*` metrics of one engine replica, labelled with the served model name."""

    def __init__(self, model_name: str) -> None:
        tags = {"model_name": model_name}
        self.ttft = Histogram("qkv_time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              _LATENCY_BUCKETS, _MODEL)
        self.itl = Histogram("qkv_inter_token_latency_seconds", "Time between two generated tokens of a request.",
                             _ITL_BUCKETS, _MODEL)
        self.e2e = Histogram("qkv_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             _E2E_BUCKETS, _MODEL)
        self.queue_time = Histogram("qkv_request_queue_time_seconds", "Time from arrival to first being scheduled.",
                                    _E2E_BUCKETS, _MODEL)
        self.prompt_tokens = Counter("qkv_prompt_tokens_total", "Prompt tokens of finished requests.", _MODEL)
        self.generation_tokens = Counter("qkv_generation_tokens_total", "Generated tokens.", _MODEL)
        self.success = Counter("qkv_request_success_total", "Finished requests by finish reason.",
                               _MODEL + ("finished_reason",))
        self.preemptions = Counter("qkv_num_preemptions_total", "Sequences preempted to free KV blocks.", _MODEL)
        self.prefix_queries = Counter("qkv_prefix_cache_queries_total",
                                      "Prompt tokens looked up in the prefix cache.", _MODEL)
        self.prefix_hits = Counter("qkv_prefix_cache_hits_total",
                                   "Prompt tokens found in the prefix cache (their K/V not recomputed).", _MODEL)
        self.spec_drafts = Counter("qkv_spec_decode_num_draft_tokens_total",
                                   "Speculative tokens proposed and verified.", _MODEL)
        self.spec_accepted = Counter("qkv_spec_decode_num_accepted_tokens_total",
                                     "Speculative tokens accepted by the target model.", _MODEL)
        self.spec_rate = Gauge("qkv_spec_decode_acceptance_rate_per_position",
                               "Accepted / proposed speculative tokens since start, per proposal position.",
                               _MODEL + ("position",))
        self.running = Gauge("qkv_num_requests_running", "Requests in the running batch.", _MODEL)
        self.waiting = Gauge("qkv_num_requests_waiting", "Requests waiting to be scheduled.", _MODEL)
        self.lora_loaded = Gauge("qkv_lora_adapters_loaded", "LoRA adapters resident in this replica.", _MODEL)
        self.lora_loads = Counter("qkv_lora_adapter_loads_total", "LoRA adapters loaded into a slot.", _MODEL)
        self.lora_evictions = Counter("qkv_lora_adapter_evictions_total",
                                      "LoRA adapters evicted from a slot (least recently used, idle).", _MODEL)
        self.lora_requests = Counter("qkv_lora_requests_total",
                                     "Finished requests (choices) run under each LoRA adapter.", _MODEL + ("lora_name",))
        self.kv_usage = Gauge("qkv_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", _MODEL)
        for metric in (self.ttft, self.itl, self.e2e, self.queue_time, self.prompt_tokens, self.generation_tokens,
                       self.success, self.preemptions, self.running, self.waiting, self.kv_usage,
                       self.prefix_queries, self.prefix_hits, self.lora_loaded, self.lora_loads, self.lora_evictions,
                       self.lora_requests):
            metric.set_default_tags(dict(tags))
        for metric in (self.spec_drafts, self.spec_accepted, self.spec_rate):
            metric.set_default_tags(dict(tags))
        self._seen = {"num_preemptions_total": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                      "lora_adapter_loads": 0, "lora_adapter_evictions": 0}
        self._unreported_tokens = 0  # generated tokens observed since the last refresh
        self._spec_seen = [0, 0]  # speculative tokens proposed / accepted at the last refresh

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
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.lora_loaded.set(getattr(stats, "lora_adapters_loaded", 0))
        # The engine keeps running totals; the counters get what was added since the last refresh.
        for name, counter in (("num_preemptions_total", self.preemptions),
                              ("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits),
                              ("lora_adapter_loads", self.lora_loads), ("lora_adapter_evictions", self.lora_evictions)):
            total = getattr(stats, name, 0)
            if total > self._seen[name]:
                counter.inc(total - self._seen[name])
            self._seen[name] = total
        self._refresh_spec(stats)

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
