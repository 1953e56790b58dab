"""The replica's Prometheus metrics, with vLLM's names, labels and buckets, in a registry of its own
(several replicas share a process in tests and demos; the global registry would mix them).

Engine state (running/waiting requests, KV usage, prefix-cache and token counters) is read from the
engine when scraped, never copied.  Counters go on the wire with the ``_total`` suffix, as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE = "0"  # vLLM's engine label: the data-parallel rank; an emulated replica has one engine
# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class EngineStats(Protocol):
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int


def cache_config_labels(block_size: int, num_gpu_blocks: int) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels: CacheConfig fields as strings, as vLLM prints them."""
    return {
        "block_size": str(block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(num_gpu_blocks),
        "prefix_caching_hash_algo": "xxhash",  # the emulator chains xxh3-64 (kvroute.common.blocks)
        "engine": ENGINE,
    }


class _EngineCollector(Collector):
    def __init__(self, model: str, engine: EngineStats, config_labels: dict[str, str],
                 started_at: Callable[[], float]):
        self._model = model
        self._engine = engine
        self._config = config_labels
        self._started_at = started_at

    def collect(self) -> Iterable[Any]:
        labels, values, e = ["model_name", "engine"], [self._model, ENGINE], self._engine

        def family(kind: type, name: str, doc: str, value: float) -> Any:
            f = kind(name, doc, labels=labels)
            f.add_metric(values, value)
            return f

        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.",
                     e.num_running)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                     e.num_waiting)
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                     e.kv_usage)
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries",
                     "Prefix cache queries, in terms of number of queried tokens.", e.prefix_cache_queries)
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits",
                     "Prefix cache hits, in terms of number of cached tokens.", e.prefix_cache_hits)
        yield family(CounterMetricFamily, "vllm:prompt_tokens", "Number of prefill tokens processed.",
                     e.prompt_tokens_total)
        yield family(CounterMetricFamily, "vllm:generation_tokens", "Number of generation tokens processed.",
                     e.generation_tokens_total)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(self._config))
        info.add_metric(list(self._config.values()), 1.0)
        yield info
        # Per replica rather than per process (replicas share a process here): a router reads it
        # to notice that a replica restarted.
        yield GaugeMetricFamily("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                                value=self._started_at())


class ReplicaMetrics:
    def __init__(self, model: str, engine: EngineStats, config_labels: dict[str, str],
                 started_at: Callable[[], float]):
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(model, engine, config_labels, started_at))
        labels = ["model_name", "engine"]
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model, ENGINE)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                              labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model, ENGINE)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*labels, "finished_reason"], registry=self.registry)
        # every series exists from the first scrape, at zero
        self._success = {reason: success.labels(model, ENGINE, reason) for reason in FINISH_REASONS}

    def first_token(self, ttft_s: float) -> None:
        self._ttft.observe(max(0.0, ttft_s))

    def finished(self, e2e_s: float, reason: str) -> None:
        self._e2e.observe(max(0.0, e2e_s))
        self._success[reason].inc()

    def aborted(self) -> None:
        self._success["abort"].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
