"""Prometheus metrics for GET /metrics.

Counters and histograms are fed on the event loop from each request's outputs (one per engine step,
so the token and verify-count differences between two outputs are that step's). Gauges are read at
scrape time from the engine loop's latest snapshot.
"""

from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.server.engine_loop import finish_type

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict], queued: Callable[[], int], num_draft_tokens: Optional[int]):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("spec_requests", "Finished requests by finish reason (stop, length, abort).",
                                ["finish_reason"], registry=reg)
        self.prompt_tokens = Counter("spec_prompt_tokens", "Prompt tokens of accepted requests.", registry=reg)
        self.generation_tokens = Counter("spec_generation_tokens", "Generated tokens.", registry=reg)
        self.ttft = Histogram("spec_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY, registry=reg)
        self.itl = Histogram("spec_inter_token_latency_seconds",
                             "Time per output token after the first (a step's time over the tokens it produced).",
                             buckets=_ITL, registry=reg)
        self.e2e = Histogram("spec_e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY, registry=reg)
        self.accept_length = None
        if num_draft_tokens:
            self.accept_length = Histogram(
                "spec_accept_length", "Tokens produced per verify step (accepted drafts + the bonus token).",
                buckets=[float(k) for k in range(1, num_draft_tokens + 1)], registry=reg)
        reg.register(_EngineCollector(snapshot, queued))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, prev: Optional[dict], prev_time: Optional[float], out: dict, now: float) -> None:
        meta = out["meta_info"]
        before = prev["meta_info"] if prev else {"completion_tokens": 0, "spec_verify_ct": 0}
        new = meta["completion_tokens"] - before["completion_tokens"]
        if new > 0:
            self.generation_tokens.inc(new)
            if not before["completion_tokens"]:
                if meta.get("ttft") is not None:
                    self.ttft.observe(meta["ttft"])
            elif prev_time is not None:
                gap = (now - prev_time) / new
                for _ in range(new):
                    self.itl.observe(gap)
            if self.accept_length is not None and meta["spec_verify_ct"] - before["spec_verify_ct"] == 1:
                self.accept_length.observe(new)
        reason = finish_type(out)
        if reason:
            self.requests.labels(reason).inc()
            self.e2e.observe(meta["e2e_latency"])


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict], queued: Callable[[], int]):
        self.snapshot, self.queued = snapshot, queued

    def collect(self):
        s = self.snapshot()
        yield GaugeMetricFamily("spec_num_running_reqs", "Requests in the running batch.", value=s["num_running_reqs"])
        yield GaugeMetricFamily("spec_num_queue_reqs", "Accepted requests still waiting for their first token.",
                                value=self.queued())
        yield GaugeMetricFamily("spec_kv_cache_used_tokens", "KV slots held by queued or running requests.",
                                value=s["kv_tokens_used"])
        yield GaugeMetricFamily("spec_kv_cache_cached_tokens", "KV slots holding reusable prefixes (evictable).",
                                value=s["kv_tokens_cached"])
        yield GaugeMetricFamily("spec_kv_cache_total_tokens", "Size of the KV pool.", value=s["kv_tokens_total"])
        yield GaugeMetricFamily("spec_token_usage", "Share of the KV pool held by requests.",
                                value=s["kv_tokens_used"] / max(s["kv_tokens_total"], 1))
        yield CounterMetricFamily("spec_retractions", "Requests retracted to free KV for others.",
                                  value=s["retractions"])
        yield CounterMetricFamily("spec_decode_steps", "Decode steps run.", value=s["decode_steps"])
        yield CounterMetricFamily("spec_decode_rows", "Tokens the decode steps' target forwards ran: one per "
                                  "request a step, plus its draft tokens.", value=s["decode_rows"])
        if "spec_verify_ct" in s:
            yield CounterMetricFamily("spec_verify_steps", "Verify steps (one per request per decode step).",
                                      value=s["spec_verify_ct"])
            yield GaugeMetricFamily("spec_accept_length_avg", "Average tokens per verify step since start.",
                                    value=s["avg_spec_accept_length"] or 0.0)
            yield GaugeMetricFamily("spec_accept_rate", "Share of the draft depth accepted per verify step.",
                                    value=s["spec_accept_rate"] or 0.0)
            by_pos = GaugeMetricFamily("spec_accept_rate_by_position",
                                       "Share of verify steps that accepted a draft token at this depth (1 = first).",
                                       labels=["position"])
            for depth, rate in enumerate(s["spec_accept_by_position"], 1):
                by_pos.add_metric([str(depth)], rate)
            yield by_pos
