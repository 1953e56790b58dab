"""Prometheus metrics of the router (prefix ``kvroute_``), in a registry of their own.

Token counters rather than ratios, so that several routers add up: the hit-rate breakdown of
docs/design.md §6 is ``reuse_X_tokens_total / prompt_tokens_total`` per model, summed over routers.
Series a dashboard names exist from the first scrape: label sets are created at zero as soon as
their values are known (models and replicas on every scrape, policy reasons at start).
Per-replica gauges are read from the fleet and the load tracker when scraped, never copied.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvroute.router.index.metrics import IndexMetrics
from kvroute.router.process_metrics import register_process_metrics, workers_process_collector
from kvroute.router.worker_metrics import UNROUTED, MULTIPROCESS, PublishedCollector, remove_series, render_workers

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OTHER_CLIENT = "other"
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}

# microseconds to tens of milliseconds: the router's own share of a request
_ADDED_LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)
_HOLD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
UPSTREAM_STAGES = ("connect", "first_byte", "mid_stream", "auth")

# No ``_created`` series: one more series per counter and histogram child that no query uses
# (Prometheus' created-timestamp ingestion reads it from OpenMetrics/protobuf, not this text).
disable_created_metrics()


class ClientLabels:
    """Caps a label's cardinality: the first ``cap`` distinct values keep their name, later ones are 'other'."""

    def __init__(self, cap: int):
        self.cap = cap
        self._known: set[str] = set()

    def __call__(self, client: str) -> str:
        if client in self._known:
            return client
        if len(self._known) < self.cap:
            self._known.add(client)
            return client
        return OTHER_CLIENT


# Per-replica gauges read from live state: (name, help, multiprocess mode).  The mode says how
# ``--workers N`` makes one value of the workers' (router/worker_metrics.py), as the dashboards
# aggregate several routers.
REPLICA_GAUGES = (
    # 1 if any worker finds it healthy (dashboards: max over routers)
    ("kvroute_replica_healthy", "1 if the replica passes health checks", "livemax"),
    # the worst state a worker's breaker is in
    ("kvroute_replica_breaker_state", "circuit breaker: 0 closed, 1 half-open, 2 open", "livemax"),
    # every worker's requests and queued tokens are at the replica together
    ("kvroute_replica_in_flight", "requests the router has in flight there", "livesum"),
    ("kvroute_replica_queued_prefill_tokens", "uncached prompt tokens sent there, first token pending", "livesum"),
    # each worker learns its own rate from its own requests: one series per worker (a pid label),
    # averaged as the dashboards average routers
    ("kvroute_replica_prefill_tokens_per_second", "learned prefill rate", "liveall"),
)
ReplicaRow = tuple[str, bool, str, int, int, float]  # name, healthy, breaker state, in flight, queued, rate


class _ReplicaCollector(Collector):
    """Per-replica gauges, read from live state at scrape time."""

    multiprocess_modes = {name: mode for name, _, mode in REPLICA_GAUGES}

    def __init__(self, source: Callable[[], Iterable[ReplicaRow]]):
        self._source = source

    def collect(self):
        families = [GaugeMetricFamily(name, help_, labels=["replica"]) for name, help_, _ in REPLICA_GAUGES]
        for name, is_healthy, breaker_state, flying, queued_tokens, prefill_rate in self._source():
            values = (1.0 if is_healthy else 0.0, BREAKER_STATES.get(breaker_state, 2), flying, queued_tokens, prefill_rate)
            for family, value in zip(families, values):
                family.add_metric([name], value)
        yield from families


class _ReplicaInfoCollector(Collector):
    """``kvroute_replica_info{replica,url,model}`` = 1: the URL behind each ``replica`` label, one
    series per model it serves (``model=""`` until its models are read)."""

    multiprocess_modes = {"kvroute_replica_info": "livemax"}

    def __init__(self, source: Callable[[], Iterable[tuple[str, str, Iterable[str]]]]):
        self._source = source

    def collect(self):
        family = GaugeMetricFamily(
            "kvroute_replica_info", "1 per replica and model: the URL behind the replica label", labels=["replica", "url", "model"]
        )
        for label, url, models in self._source():
            for model in sorted(models) or [""]:
                family.add_metric([label, url, model], 1.0)
        yield family


# -- overload: the admission queue (router/edge/overload/, design.md §7.6) -------------------------
# Labels are bounded: the priority class (3) and the reason (4), never a tenant.
SHED_REASONS = ("no_queue", "saturated", "stale", "over_budget", "displaced", "timeout", "over_share")
PRIORITY_CLASSES = ("high", "normal", "low")
_QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)


class OverloadMetrics:
    """``kvroute_queue_depth``, ``kvroute_queue_wait_seconds`` (every admitted request: 0 for those
    that found room at once, so its quantiles are the share of all requests that waited),
    ``kvroute_shed_requests_total{reason,priority}`` (429s: ``no_queue`` at the limit without a queue,
    ``saturated`` at the limit while the router's own CPU is saturated (not queued), ``stale`` read
    past ``STALE_S`` after its last byte reached the kernel (overload/saturation.py), ``over_budget`` refused on arrival, ``displaced`` pushed out of the queue, ``timeout`` waited the
    budget out, ``over_share`` refused at the door: its tenant over its fair share of a router short of
    CPU, overload/shares.py), ``kvroute_admission_limit`` (the in-flight limit saturation sets),
    ``kvroute_fair_share_rate`` (the rate the shares split, 0 while none apply) and
    ``kvroute_event_loop_lag_seconds``; each worker's own, added up (the lag: the worst)."""

    def __init__(self, registry: CollectorRegistry):
        self.queue_depth = Gauge(
            "kvroute_queue_depth", "requests waiting in the admission queue", multiprocess_mode="livesum",
            registry=registry,
        )
        self.queue_wait = Histogram(
            "kvroute_queue_wait_seconds", "time an admitted request waited in the admission queue (0: room at once)",
            buckets=_QUEUE_WAIT_BUCKETS, registry=registry,
        )
        self.shed_requests = Counter(
            "kvroute_shed_requests", "requests refused 429 router_overloaded, by reason and priority class",
            ["reason", "priority"], registry=registry,
        )
        self.limit = Gauge(
            "kvroute_admission_limit", "requests admitted at once: max_in_flight, lowered while the router is saturated",
            multiprocess_mode="livesum", registry=registry,
        )
        self.share_rate = Gauge(
            "kvroute_fair_share_rate", "requests per second the router admits while short of CPU, split in fair "
            "shares among its tenants (0: no shares apply)", multiprocess_mode="livesum", registry=registry,
        )
        self.loop_lag = Gauge(
            "kvroute_event_loop_lag_seconds", "how late the event loop ran a timer at the last check (every 50 ms)",
            multiprocess_mode="livemax", registry=registry,
        )
        self._shed = {(reason, priority): self.shed_requests.labels(reason, priority)
                      for reason in SHED_REASONS for priority in PRIORITY_CLASSES}

    def shed(self, reason: str, priority: Any) -> None:
        """``priority``: a class with a ``label`` (router/edge/overload/tenants.py's ``Priority``)."""
        self._shed[(reason, priority.label)].inc()


@dataclass
class ModelSeries:
    """One model's children of the labelled metrics, bound once (``labels()`` costs microseconds)."""

    prompt_tokens: Any
    reuse_available: Any
    reuse_predicted: Any
    reuse_delivered: Any
    reuse_measured_prompt: Any
    ttft: Any
    sre: SreSeries


# -- SRE: what a model's clients get (end to end, TTFT, inter-token latency, output tokens) --------
# seconds to minutes: a whole answer, its generation included
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
# milliseconds: one decode step of an engine, batched or not
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


@dataclass
class SreSeries:
    """One model's children of the SRE metrics (``SreMetrics``), bound once."""

    duration: Any
    inter_token_latency: Any
    output_tokens: Any


class SreMetrics:
    """Histograms and counters an SLO is written against, labelled by model only (bounded: models
    the fleet serves, else ``unknown``).  TTFT is ``kvroute_ttft_seconds`` (above)."""

    def __init__(self, registry: CollectorRegistry):
        self.duration = Histogram(
            "kvroute_request_duration_seconds",
            "end to end: from the request's arrival to the last byte of its answer, answered (2xx) requests",
            ["model"], buckets=_DURATION_BUCKETS, registry=registry,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "kvroute_inter_token_latency_seconds",
            "a stream's mean time between output tokens: (last event - first event) / (output tokens - 1)",
            ["model"], buckets=_ITL_BUCKETS, registry=registry,
        )  # fmt: skip
        self.output_tokens = Counter(
            "kvroute_output_tokens",
            "output tokens of answered requests: the usage the replica reports, else a stream's events",
            ["model"], registry=registry,
        )  # fmt: skip

    def model(self, model: str) -> SreSeries:
        return SreSeries(
            self.duration.labels(model), self.inter_token_latency.labels(model), self.output_tokens.labels(model)
        )


class RouterMetrics:
    def __init__(self, policy: str, reasons: Iterable[str] = (), max_client_labels: int = 100):
        self.policy = policy
        self.registry = r = CollectorRegistry()
        self.client_label = ClientLabels(max_client_labels)
        self.requests = Counter(
            "kvroute_requests", "requests answered, by model, replica and HTTP status", ["model", "replica", "status"], registry=r
        )
        self.decisions = Counter(
            "kvroute_routing_decisions", "routing decisions by policy and reason", ["policy", "reason"], registry=r
        )
        self.added_latency = Histogram(
            "kvroute_router_added_latency_seconds",
            "time in the router before the upstream request is sent (parse, tokenize, hash, index, policy)",
            buckets=_ADDED_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_ttft_seconds", "time to first token as the router sees it", ["model"], buckets=_TTFT_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("kvroute_prompt_tokens", "prompt tokens routed", ["model"], registry=r)
        self.reuse_available = Counter(
            "kvroute_reuse_available_tokens",
            "prompt tokens (full blocks) an earlier prompt in the window shared as a prefix",
            ["model"],
            registry=r,
        )
        self.reuse_predicted = Counter(
            "kvroute_reuse_predicted_tokens", "prompt tokens the chosen replica was believed to hold", ["model"], registry=r
        )
        self.reuse_delivered = Counter(
            "kvroute_reuse_delivered_tokens", "prompt tokens the engine reported cached (cached_tokens)", ["model"], registry=r
        )
        self.reuse_measured_prompt = Counter(
            "kvroute_reuse_measured_prompt_tokens",
            "prompt tokens of the requests whose engine reported cached_tokens (the denominator of delivered)",
            ["model"],
            registry=r,
        )
        self.cache_hostile = Counter(
            "kvroute_cache_hostile_prompts",
            "prompts whose first block is new while a long later stretch was seen before",
            ["client"],
            registry=r,
        )
        self.in_flight = Gauge("kvroute_in_flight", "requests the router is proxying", multiprocess_mode="livesum", registry=r)
        self.upstream_failures = Counter(
            "kvroute_upstream_failures", "upstream failures by replica and stage", ["replica", "stage"], registry=r
        )
        # set by the worker a scrape reaches, just before it answers: with Redis every worker reads
        # the same count, so the latest is right; with the in-memory index it is that worker's
        self.index_entries = Gauge(
            "kvroute_index_entries", "prefix-index entries held per replica", ["replica"],
            multiprocess_mode="livemostrecent", registry=r,
        )
        self.index = IndexMetrics(r)  # the index client's calls, failures and rebuilds
        self.sre = SreMetrics(r)  # end to end, inter-token latency, output tokens per model
        register_process_metrics(r)  # process_*: this process, or the supervisor and its workers
        self.overload = OverloadMetrics(r)  # the admission queue (router/edge/overload/)
        # late binding (placement/hold.py): requests held at the router for a replica with room
        self.held_now = Gauge("kvroute_held_requests", "requests held at the router until their replica has room",
                              multiprocess_mode="livesum", registry=r)
        self.hold_wait = Histogram(
            "kvroute_hold_wait_seconds", "time a request was held at the router, by how the hold ended (room: the "
            "replica had room; budget: --hold-max-s was spent)", ["ended"], buckets=_HOLD_BUCKETS, registry=r,
        )
        # series known from the start
        for reason in reasons:
            self.decisions.labels(policy, reason)
        self.decisions.labels(policy, "failover")
        self.cache_hostile.labels(OTHER_CLIENT)
        self._models: dict[str, ModelSeries] = {}
        self._replicas: set[tuple[str, str]] = set()
        self._decisions: dict[str, Any] = {}
        self._answered: dict[tuple[str, str, int], Any] = {}  # requests' children by (model, replica, status)
        self._published: list[PublishedCollector] = []
        # -- replica labels: the name discovery gives (fleet/discovery/labels.py), not the URL ----
        self.replica_label: Callable[[str], str] = str  # replica name (URL) -> label; the app binds the fleet's
        self._labels_used: dict[str, str] = {}  # name -> the label its series were created with

    def held(self, seconds: float, roomy: bool) -> None:
        """A request's hold ended after ``seconds``: its replica had room (``roomy``), or the budget was spent."""
        self.hold_wait.labels("room" if roomy else "budget").observe(seconds)

    def bind_replicas(self, source: Callable[[], Iterable[ReplicaRow]]) -> None:
        """``source`` yields (label, healthy, breaker state, in flight, queued tokens, prefill rate)."""
        self.register_live(_ReplicaCollector(source))

    def bind_replica_info(self, source: Callable[[], Iterable[tuple[str, str, Iterable[str]]]]) -> None:
        """``source`` yields (label, URL, models) per replica."""
        self.register_live(_ReplicaInfoCollector(source))

    def label(self, replica: str) -> str:
        """The ``replica`` label of the replica named (by URL) ``replica``; ``none`` stays."""
        if replica == UNROUTED:
            return replica
        label = self._labels_used[replica] = self.replica_label(replica)
        return label

    def upstream_failed(self, replica: str, stage: str) -> None:
        self.upstream_failures.labels(self.label(replica), stage).inc()

    def register_live(self, collector: Collector) -> None:
        """A collector of gauges read at scrape time.  In multiprocess mode its values are written
        to the files by ``publish()`` instead, each family by its rule in ``collector.multiprocess_modes``."""
        if MULTIPROCESS:
            self._published.append(PublishedCollector(collector, collector.multiprocess_modes))  # type: ignore[attr-defined]
        else:
            self.registry.register(collector)

    def publish(self) -> None:
        """Multiprocess mode: write the values read at scrape time to the files (a no-op otherwise)."""
        if not MULTIPROCESS:
            return
        for published in self._published:
            published.publish()
        self.index.publish()

    def model(self, model: str) -> ModelSeries:
        """A model's series, created at zero the first time."""
        series = self._models.get(model)
        if series is None:
            series = self._models[model] = ModelSeries(
                prompt_tokens=self.prompt_tokens.labels(model),
                reuse_available=self.reuse_available.labels(model),
                reuse_predicted=self.reuse_predicted.labels(model),
                reuse_delivered=self.reuse_delivered.labels(model),
                reuse_measured_prompt=self.reuse_measured_prompt.labels(model),
                ttft=self.ttft.labels(model),
                sre=self.sre.model(model),
            )
        return series

    def decision(self, reason: str) -> None:
        child = self._decisions.get(reason)
        if child is None:
            child = self._decisions[reason] = self.decisions.labels(self.policy, reason)
        child.inc()

    def answered(self, model: str, replica: str, status: int) -> None:
        """Count a request answered (its child bound once per label set: ``labels()`` costs microseconds)."""
        key = (model, replica, status)
        child = self._answered.get(key)
        if child is None:
            child = self._answered[key] = self.requests.labels(model, self.label(replica), str(status))
        child.inc()

    def know_model(self, model: str, replicas: Iterable[str] = ()) -> None:
        """Create a model's series (and its replicas' request series) at zero."""
        self.model(model)
        for replica in replicas:
            if (model, replica) not in self._replicas:
                self._replicas.add((model, replica))
                label = self.label(replica)
                self.requests.labels(model, label, "200")
                self.index_entries.labels(label)
                for stage in UPSTREAM_STAGES:
                    self.upstream_failures.labels(label, stage)

    def forget_replica(self, replica: str) -> None:
        """A replica left: drop every series naming it.  Replicas come and go (pods get new
        addresses on every restart): the series of departed ones must not pile up for ever."""
        label = self._labels_used.pop(replica, replica)
        for metric, position in ((self.requests, 1), (self.upstream_failures, 0), (self.index_entries, 0)):
            # prometheus_client has no public way to list a metric's children
            for labels in [labels for labels in metric._metrics if labels[position] == label]:
                remove_series(metric, *labels)
        self._replicas = {(m, r) for m, r in self._replicas if r != replica}
        self._answered = {key: child for key, child in self._answered.items() if key[1] != replica}

    def hostile(self, client: str) -> None:
        self.cache_hostile.labels(self.client_label(client)).inc()

    def render(self, replicas: Collection[str] = ()) -> bytes:
        """The exposition; in multiprocess mode every worker's, ``replicas`` the labels of the fleet's current ones."""
        if MULTIPROCESS:
            return render_workers(replicas, workers_process_collector())
        return generate_latest(self.registry)
