"""The server's Prometheus metrics: latencies and outcomes of requests, and the scheduler's state, read from
its stats() when /metrics is scraped."""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class RequestTiming:
    """When a request arrived and when its tokens came (time.perf_counter)."""

    def __init__(self):
        self.arrival = time.perf_counter()
        self.first = self.last = 0.0
        self.tokens = 0

    def token(self):
        self.last = time.perf_counter()
        self.first = self.first or self.last
        self.tokens += 1


class SchedulerCollector:
    """Gauges and counters of the scheduler, taken from one stats() call per scrape."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        stats = self.scheduler.stats()
        yield GaugeMetricFamily("hybridjit_queue_length", "Requests waiting for a slot", value=stats["queue"])
        yield GaugeMetricFamily("hybridjit_slots", "Decode slots", value=stats["slots"])
        yield GaugeMetricFamily("hybridjit_slots_in_use", "Slots holding a request", value=stats["slots_in_use"])
        yield CounterMetricFamily(
            "hybridjit_prefix_cache_hits", "Prompts that reused a cached prefix", value=stats["prefix_cache_hits"]
        )
        yield CounterMetricFamily(
            "hybridjit_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            value=stats["prefix_cache_hit_tokens"],
        )
        yield GaugeMetricFamily(
            "hybridjit_prefix_cache_bytes", "Memory held by the prefix cache", value=stats["prefix_cache_bytes"]
        )


class ServerMetrics:
    """One registry per server (not prometheus_client's global one), so that servers in one process stay apart."""

    def __init__(self, scheduler):
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "hybridjit_time_to_first_token_seconds",
            "From a request's arrival to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "hybridjit_time_per_output_token_seconds",
            "A request's mean time per generated token after the first",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "hybridjit_requests",
            "Requests that ran, by how they ended (cancelled: the client went away)",
            ["finish_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "hybridjit_requests_rejected", "Requests turned away because the queue was full", registry=self.registry
        )
        self.prompt_tokens = Counter("hybridjit_prompt_tokens", "Prompt tokens of requests", registry=self.registry)
        self.generation_tokens = Counter("hybridjit_generation_tokens", "Generated tokens", registry=self.registry)
        self.registry.register(SchedulerCollector(scheduler))

    def request_ended(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, timing: RequestTiming):
        """Records a request that ran, however it ended."""
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if timing.tokens:
            self.ttft.observe(timing.first - timing.arrival)
        if timing.tokens > 1:
            self.tpot.observe((timing.last - timing.first) / (timing.tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
