"""Writes the Grafana dashboards of kvroute (``dashboards/*.json``, Grafana's JSON model).

    python dashboards/build.py            # rewrite the JSON files
    python dashboards/build.py --check    # exit 1 if a committed file differs from what this writes

The panels are declared here, once, as data; the JSON files are the output that Grafana's
provisioning (deploy/grafana) and "Import dashboard" read.  Every query names metrics that kvroute
(router/metrics.py, router/kvevents) or vLLM export; tests/test_observe.py evaluates each of them
against a real Prometheus scraping a router under load.

Variables: ``$datasource`` (a Prometheus); ``$namespace`` and ``$job`` (the routers' scrape
targets); ``$model`` (kvroute's ``model`` label, which equals vLLM's ``model_name``); ``$replica``
(kvroute's ``replica`` label: the name discovery gives a replica, its URL in ``kvroute_replica_info``).  Each is read with ``label_values`` and has an
"All" option (the regex ``.*``).  Every panel honours ``$namespace``, ``$job`` and ``$replica``:
series with a ``replica`` label are filtered by it; router-wide series (latency, decisions, the
index) are those of the routers that front a selected replica; the engines' series (``vllm:*``,
by ``instance``, the replica's host:port) are those whose ``instance`` is the host:port of a selected
replica's URL (``kvroute_replica_info``).  Every panel declares its unit and says what it shows.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    _: KW_ONLY
    unit: str  # Grafana's unit id: s, percentunit, reqps, ops, short, ...
    description: str
    kind: str = "timeseries"  # timeseries | stat | table | bargauge
    width: int = 12
    height: int = 8
    max: float | None = None
    mappings: list[dict] = field(default_factory=list)


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict:
    targets = []
    for i, (expr, legend) in enumerate(p.targets):
        t = {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend, "range": True}
        if p.kind in ("table", "bargauge"):
            t.update(instant=True, range=False, format="table" if p.kind == "table" else "time_series")
        targets.append(t)
    defaults: dict = {"unit": p.unit, "mappings": p.mappings}
    if p.max is not None:
        defaults.update(min=0, max=p.max)
    out: dict = {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DS,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
    }
    if p.kind == "timeseries":
        out["options"] = {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}
    elif p.kind == "stat":
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value", "graphMode": "area"}
    elif p.kind == "bargauge":
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "orientation": "horizontal"}
    return out


def _variable(name: str, label: str, query: str, *, include_all: bool = True) -> dict:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": f"var-{name}"},
        "refresh": 2,  # on time range change: replicas come and go
        "includeAll": include_all,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


T = 'namespace=~"$namespace",job=~"$job"'  # the routers' scrape targets

VARIABLES = {
    "datasource": {
        "type": "datasource",
        "name": "datasource",
        "label": "Data source",
        "query": "prometheus",
        "current": {},
    },
    "namespace": _variable("namespace", "Namespace", "label_values(kvroute_in_flight, namespace)"),
    "job": _variable("job", "Router job", 'label_values(kvroute_in_flight{namespace=~"$namespace"}, job)'),
    "model": _variable("model", "Model", f"label_values(kvroute_prompt_tokens_total{{{T}}}, model)"),
    "replica": _variable("replica", "Replica", f"label_values(kvroute_replica_healthy{{{T}}}, replica)"),
}


def dashboard(uid: str, title: str, description: str, variables: list[str], panels: list[Panel]) -> dict:
    laid, x, y, row_h = [], 0, 0, 0
    for pid, p in enumerate(panels, start=1):
        if x + p.width > 24:
            x, y, row_h = 0, y + row_h, 0
        laid.append(_panel_json(p, pid, x, y))
        x, row_h = x + p.width, max(row_h, p.height)
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["kvroute"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "graphTooltip": 1,
        "links": [{"type": "dashboards", "tags": ["kvroute"], "asDropdown": True, "title": "kvroute"}],
        "annotations": {"list": []},
        "templating": {"list": [VARIABLES[v] for v in variables]},
        "panels": laid,
    }


M = 'model=~"$model"'
MN = 'model_name=~"$model"'
R = 'replica=~"$replica"'
TR = f"{T},{R}"
TM = f"{T},{M}"
TMR = f"{T},{M},{R}"
S5 = 'status=~"5.."'
ROUTED = 'replica!="none"'
# the routers that front a selected replica, and the engines' scrape targets that are one
ROUTERS = f"group by (namespace, job, instance) (kvroute_replica_healthy{{{TR}}})"
# (the replica label is the name discovery gives; its URL, whose host:port is the engine's
# instance, is in kvroute_replica_info)
ENGINES = (f'label_replace(group by (replica, url) (kvroute_replica_info{{{TR}}}), '
           f'"instance", "$1", "url", "[a-z]+://([^/]+).*")')
BREAKER = [{"type": "value", "options": {"0": {"text": "closed", "color": "green"},
                                          "1": {"text": "half-open", "color": "orange"},
                                          "2": {"text": "open", "color": "red"}}}]
HEALTH = [{"type": "value", "options": {"0": {"text": "down", "color": "red"}, "1": {"text": "up", "color": "green"}}}]
ROUTER_WIDE = " Router-wide series: those of the routers in front of the selected replicas."
ENGINE_SIDE = " The engines' own series (vLLM /metrics), of the selected replicas."


def routed(selector: str) -> str:
    """A router-wide series (no replica label) kept for the routers that front a selected replica."""
    return f"{selector} and on (namespace, job, instance) {ROUTERS}"


def rate(metric: str, sel: str, window: str = RI) -> str:
    return f"rate({metric}{{{sel}}}[{window}])"


def rrate(metric: str, sel: str = T, window: str = RI) -> str:
    """rate() of a router-wide counter, of the routers that front a selected replica."""
    return routed(rate(metric, sel, window))


def erate(metric: str, sel: str = MN) -> str:
    """rate() of an engine counter, of the selected replicas."""
    return f"{rate(metric, sel)} and on (instance) {ENGINES}"


def _q(q: float, by: str, rated: str) -> str:
    return f"histogram_quantile({q}, sum by ({by}) ({rated}))"


def _ratio(num: str, den: str, by: str, sel: str) -> str:
    return f"sum by ({by}) ({rrate(num, sel)})\n  / sum by ({by}) ({rrate(den, sel)})"


def _share(num: str, den: str, sel: str) -> str:
    """Over the dashboard's range, router-wide counters."""
    return (f"sum({routed(f'increase({num}{{{sel}}}[$__range])')})\n"
            f"  / sum({routed(f'increase({den}{{{sel}}}[$__range])')})")


FLEET = dashboard(
    "kvroute-fleet",
    "kvroute / Fleet overview",
    "Requests, errors, router-added latency and time to first token across every router.",
    ["datasource", "namespace", "job", "model", "replica"],
    [
        Panel("Requests / s", [(f"sum({rate('kvroute_requests_total', TMR)})", "requests/s")],
              unit="reqps", kind="stat", width=6, height=4,
              description="Requests the routers answered per second (replica \"none\": answered without one)."),
        Panel("5xx ratio", [(f'(sum({rate("kvroute_requests_total", f"{TMR},{S5}")}) '
                             f"or vector(0))\n  / sum({rate('kvroute_requests_total', TMR)})", "5xx")],
              unit="percentunit", kind="stat", width=6, height=4,
              description="Share of the routers' answers that are 5xx (502/503/504: no healthy replica, upstream "
                          "failures after retries, timeouts)."),
        Panel("Healthy replicas", [(f"sum(max by (replica) (kvroute_replica_healthy{{{TR}}}))", "healthy")],
              unit="short", kind="stat", width=6, height=4,
              description="Replicas passing health checks (max over routers, so each counts once)."),
        Panel("Requests in flight", [(f"sum(kvroute_replica_in_flight{{{TR}}})", "in flight")],
              unit="short", kind="stat", width=6, height=4,
              description="Requests the routers are proxying to the selected replicas right now."),
        Panel("Requests by status", [(f"sum by (status) ({rate('kvroute_requests_total', TMR)})", "{{status}}")],
              unit="reqps", description="Answers per second by HTTP status."),
        Panel("Requests by model", [(f"sum by (model) ({rate('kvroute_requests_total', TMR)})", "{{model}}")],
              unit="reqps", description="Answers per second by model."),
        Panel("Error ratio by model",
              [(f'(sum by (model) ({rate("kvroute_requests_total", f"{TMR},{S5}")})\n'
                f"  or sum by (model) ({rate('kvroute_requests_total', TMR)}) * 0)\n"
                f"  / sum by (model) ({rate('kvroute_requests_total', TMR)})", "{{model}}")],
              unit="percentunit", description="Share of the router's answers that are 5xx (0 when there were none)."),
        Panel("Router-added latency",
              [(_q(0.5, "le", rrate("kvroute_router_added_latency_seconds_bucket")), "p50"),
               (_q(0.99, "le", rrate("kvroute_router_added_latency_seconds_bucket")), "p99")],
              unit="s", description="Time in the router before the upstream request is sent: parse, tokenize, "
                                    "hash, index lookup, policy." + ROUTER_WIDE),
        Panel("TTFT seen by the router",
              [(_q(0.5, "le, model", rrate("kvroute_ttft_seconds_bucket", TM)), "p50 {{model}}"),
               (_q(0.99, "le, model", rrate("kvroute_ttft_seconds_bucket", TM)), "p99 {{model}}")],
              unit="s", description="From the request's arrival to the first token the router relays, per model."
                                    + ROUTER_WIDE),
        Panel("TTFT reported by the engines (vLLM)",
              [(_q(0.5, "le, model_name", erate("vllm:time_to_first_token_seconds_bucket")), "p50 {{model_name}}"),
               (_q(0.99, "le, model_name", erate("vllm:time_to_first_token_seconds_bucket")), "p99 {{model_name}}")],
              unit="s", description="The engines' own time to first token, per model." + ENGINE_SIDE),
        # -- what clients get: end to end, inter-token latency, output tokens (with TTFT above) -----
        Panel("End-to-end duration",
              [(_q(0.5, "le, model", rrate("kvroute_request_duration_seconds_bucket", TM)), "p50 {{model}}"),
               (_q(0.99, "le, model", rrate("kvroute_request_duration_seconds_bucket", TM)), "p99 {{model}}")],
              unit="s", width=6, description="From a request's arrival to the last byte of its answer, answered (2xx) "
                                             "requests, per model." + ROUTER_WIDE),
        Panel("Inter-token latency",
              [(_q(0.5, "le, model", rrate("kvroute_inter_token_latency_seconds_bucket", TM)), "p50 {{model}}"),
               (_q(0.99, "le, model", rrate("kvroute_inter_token_latency_seconds_bucket", TM)), "p99 {{model}}")],
              unit="s", width=6, description="A stream's mean time between output tokens (its decode speed as the "
                                             "client sees it), per model." + ROUTER_WIDE),
        Panel("Output tokens / s",
              [(f"sum by (model) ({rrate('kvroute_output_tokens_total', TM)})", "{{model}}")],
              unit="short", width=6, description="Output tokens of answered requests per second (the replicas' usage, "
                                                 "else a stream's events), per model." + ROUTER_WIDE),
        Panel("Output tokens per answer",
              [(f"sum by (model) ({rrate('kvroute_output_tokens_total', TM)})\n"
                f"  / sum by (model) ({rrate('kvroute_request_duration_seconds_count', TM)})", "{{model}}")],
              unit="short", width=6, description="Mean output tokens of an answered request, per model: a change "
                                                 "explains a change of end-to-end duration." + ROUTER_WIDE),
        Panel("Routing decisions by reason",
              [(f"sum by (policy, reason) ({rrate('kvroute_routing_decisions_total')})", "{{policy}} {{reason}}")],
              unit="ops", description="cache: the chosen replica holds a prefix; load: none does, least work; "
                                      "balance: the bounded-load rule overrode; session: the session hint kept it; "
                                      "failover: a retry after a failure." + ROUTER_WIDE),
        Panel("Upstream failures by stage",
              [(f"sum by (stage) ({rate('kvroute_upstream_failures_total', TR)})", "{{stage}}")],
              unit="ops", description="connect / first_byte failures are retried on another replica; "
                                      "mid_stream ones end the stream with an error event."),
        Panel("Router CPU",
              [(f"sum by (instance) ({rrate('process_cpu_seconds_total')})", "{{instance}}")],
              unit="short", description="Cores each router uses (with --workers: its supervisor and workers "
                                        "together)." + ROUTER_WIDE),
        Panel("Router memory",
              [(f"sum by (instance) ({routed(f'process_resident_memory_bytes{{{T}}}')})", "{{instance}}")],
              unit="bytes", description="Resident memory of each router (with --workers: its processes summed)."
                                        + ROUTER_WIDE),
        # -- overload: the admission queue (docs/design.md §7.6) --
        Panel("Admission queue depth", [(f"sum by (instance) ({routed(f'kvroute_queue_depth{{{T}}}')})", "{{instance}}")],
              unit="short", width=6, description="Requests waiting for room in each router's admission queue "
                                                 "(all its workers)." + ROUTER_WIDE),
        Panel("Queue wait",
              [(_q(0.5, "le", rrate("kvroute_queue_wait_seconds_bucket")), "p50"),
               (_q(0.99, "le", rrate("kvroute_queue_wait_seconds_bucket")), "p99")],
              unit="s", width=6, description="How long admitted requests waited for room (0 when they found it "
                                             "at once; at most max_queue_wait_s)." + ROUTER_WIDE),
        Panel("Shed requests / s by reason and class",
              [(f"sum by (reason, priority) ({rrate('kvroute_shed_requests_total')})", "{{reason}} {{priority}}")],
              unit="reqps", width=6, description="Requests answered 429 router_overloaded: over_budget (refused on "
                                                 "arrival), displaced (pushed out by a more urgent or fairer one), "
                                                 "timeout (waited the budget out), no_queue (max_queue_wait_s 0), "
                                                 "saturated (no room while the router's own CPU is saturated), "
                                                 "over_share (a tenant over its fair share while the router is short "
                                                 "of CPU, refused at the door), stale (waited in the kernel)."
                                                 + ROUTER_WIDE),
        Panel("Event-loop lag", [(f"max by (instance) ({routed(f'kvroute_event_loop_lag_seconds{{{T}}}')})",
                                  "{{instance}}")],
              unit="s", width=6, description="How late each router's event loop runs (its worst worker): above "
                                             "saturated_loop_lag_s the router lowers its admission limit and "
                                             "requests queue." + ROUTER_WIDE),
    ],
)

CACHE = dashboard(
    "kvroute-cache",
    "kvroute / Cache",
    "Prefix reuse broken down (docs/design.md §6): available (an infinite shared cache), predicted (what the "
    "router believed the chosen replica held), delivered (what the engine reported cached).",
    ["datasource", "namespace", "job", "model", "replica"],
    [
        Panel("Reuse available",
              [(_share("kvroute_reuse_available_tokens_total", "kvroute_prompt_tokens_total", TM), "available")],
              unit="percentunit", kind="stat", width=8, height=4, max=1,
              description="Prompt tokens an earlier prompt shared as a prefix, over the range: what an infinite "
                          "shared cache would reuse." + ROUTER_WIDE),
        Panel("Reuse predicted",
              [(_share("kvroute_reuse_predicted_tokens_total", "kvroute_prompt_tokens_total", TM), "predicted")],
              unit="percentunit", kind="stat", width=8, height=4, max=1,
              description="Prompt tokens the chosen replica was believed to hold, over the range." + ROUTER_WIDE),
        Panel("Reuse delivered",
              [(_share("kvroute_reuse_delivered_tokens_total", "kvroute_reuse_measured_prompt_tokens_total", TM),
                "delivered")],
              unit="percentunit", kind="stat", width=8, height=4, max=1,
              description="Prompt tokens the engines reported cached, over the prompts whose engine reports "
                          "cached_tokens." + ROUTER_WIDE),
        Panel("Reuse per model: available vs predicted vs delivered",
              [(_ratio("kvroute_reuse_available_tokens_total", "kvroute_prompt_tokens_total", "model", TM),
                "available {{model}}"),
               (_ratio("kvroute_reuse_predicted_tokens_total", "kvroute_prompt_tokens_total", "model", TM),
                "predicted {{model}}"),
               (_ratio("kvroute_reuse_delivered_tokens_total", "kvroute_reuse_measured_prompt_tokens_total", "model",
                       TM), "delivered {{model}}")],
              unit="percentunit", max=1, width=24, height=9,
              description="Fractions of prompt tokens. Delivered far below available: routing does not follow the "
                          "cache. Predicted above delivered: the index believes blocks the engines evicted."
                          + ROUTER_WIDE),
        Panel("Delivered / available per model",
              [(f"sum by (model) ({rrate('kvroute_reuse_delivered_tokens_total', TM)})\n"
                f"  / sum by (model) ({rrate('kvroute_reuse_available_tokens_total', TM)})", "{{model}}")],
              unit="percentunit", description="How much of the reuse that existed the fleet actually got."
                                              + ROUTER_WIDE),
        Panel("Prompt tokens / s per model",
              [(f"sum by (model) ({rrate('kvroute_prompt_tokens_total', TM)})", "routed {{model}}"),
               (f"sum by (model) ({rrate('kvroute_reuse_delivered_tokens_total', TM)})", "cached {{model}}")],
              unit="short", description="Prompt tokens routed per second, and those the engines reported cached."
                                        + ROUTER_WIDE),
        Panel("Engine prefix-cache hit rate per replica",
              [(f"sum by (instance) ({erate('vllm:prefix_cache_hits_total')})\n"
                f"  / sum by (instance) ({erate('vllm:prefix_cache_queries_total')})", "{{instance}}")],
              unit="percentunit", max=1, description="vLLM's own counters: cached tokens over queried tokens."
                                                     + ENGINE_SIDE),
        Panel("Cached prompt tokens / s per replica",
              [(f"sum by (instance) ({erate('vllm:prefix_cache_hits_total')})", "{{instance}}")],
              unit="short", description="Prompt tokens each engine found in its prefix cache, per second."
                                        + ENGINE_SIDE),
        Panel("Cache-hostile prompts by client",
              [(f"topk(10, sum by (client) "
                f"({routed(f'increase(kvroute_cache_hostile_prompts_total{{{T}}}[$__range])')}))", "{{client}}")],
              unit="short", kind="bargauge",
              description="Prompts whose first block is new while a long later stretch was seen before (a "
                          "timestamp or user id at the start of the system prompt defeats every prefix cache), "
                          "over the range." + ROUTER_WIDE),
        Panel("Cache-hostile prompts / s by client",
              [(f"sum by (client) ({rrate('kvroute_cache_hostile_prompts_total')})", "{{client}}")], unit="ops",
              description="The same prompts per second, by client (`user` field or API-key digest)." + ROUTER_WIDE),
    ],
)

REPLICAS = dashboard(
    "kvroute-replicas",
    "kvroute / Replicas",
    "Per-replica load, health and routing share, from the routers (kvroute_replica_*) and the engines (vllm:*).",
    ["datasource", "namespace", "job", "model", "replica"],
    [
        Panel("Health (router's checks)", [(f"max by (replica) (kvroute_replica_healthy{{{TR}}})", "{{replica}}")],
              unit="short", mappings=HEALTH, max=1,
              description="1 up, 0 down: the routers' health checks (best over routers)."),
        Panel("Circuit breaker", [(f"max by (replica) (kvroute_replica_breaker_state{{{TR}}})", "{{replica}}")],
              unit="short", mappings=BREAKER, max=2, description="0 closed, 1 half-open, 2 open (worst over routers)."),
        Panel("Routing share",
              [(f'sum by (replica) ({rate("kvroute_requests_total", f"{TMR},{ROUTED}")})\n'
                f'  / ignoring (replica) group_left () '
                f'sum({rate("kvroute_requests_total", f"{TM},{ROUTED}")})',
                "{{replica}}")],
              unit="percentunit", max=1, description="Each replica's share of the routed requests (all routers)."),
        Panel("Router in-flight per replica",
              [(f"sum by (replica) (kvroute_replica_in_flight{{{TR}}})", "{{replica}}")],
              unit="short", description="Requests the routers have in flight at each replica."),
        Panel("Queued prefill tokens (router's view)",
              [(f"sum by (replica) (kvroute_replica_queued_prefill_tokens{{{TR}}})", "{{replica}}")],
              unit="short",
              description="Uncached prompt tokens sent to the replica whose first token has not come back."),
        Panel("Learned prefill rate", [(f"avg by (replica) (kvroute_replica_prefill_tokens_per_second{{{TR}}})", "{{replica}}")],
              unit="short", description="Prompt tokens per second, learned from observed TTFTs (cost model)."),
        Panel("Engine: running requests",
              [(f"sum by (instance) (vllm:num_requests_running{{{MN}}} and on (instance) {ENGINES})", "{{instance}}")],
              unit="short", description="Requests the engine is running (decoding or prefilling)." + ENGINE_SIDE),
        Panel("Engine: waiting requests",
              [(f"sum by (instance) (vllm:num_requests_waiting{{{MN}}} and on (instance) {ENGINES})", "{{instance}}")],
              unit="short", description="Requests queued in the engine for a batch slot or KV blocks." + ENGINE_SIDE),
        Panel("Engine: KV-cache usage",
              [(f"max by (instance) (vllm:kv_cache_usage_perc{{{MN}}} and on (instance) {ENGINES})", "{{instance}}")],
              unit="percentunit", max=1,
              description="Share of the engine's KV blocks in use; near 1 it evicts cached prefixes." + ENGINE_SIDE),
        Panel("Engine: TTFT p99 per replica",
              [(_q(0.99, "le, instance", erate("vllm:time_to_first_token_seconds_bucket")), "{{instance}}")],
              unit="s", description="The engine's own time to first token, p99." + ENGINE_SIDE),
        Panel("Upstream failures by replica",
              [(f"sum by (replica, stage) ({rate('kvroute_upstream_failures_total', TR)})", "{{replica}} {{stage}}")],
              unit="ops", description="Failed upstream requests per second, by replica and stage (connect, "
                                      "first_byte, mid_stream)."),
        Panel("Engine cache configuration",
              [(f"max by (instance, model_name, block_size, num_gpu_blocks, prefix_caching_hash_algo) "
                f"(vllm:cache_config_info{{{MN}}} and on (instance) {ENGINES})", "")],
              unit="short", kind="table",
              description="Block size and KV capacity each engine reports (the router reads them too)."
                          + ENGINE_SIDE),
    ],
)

INDEX = dashboard(
    "kvroute-index",
    "kvroute / Index",
    "The prefix index: entries, Redis latency and errors, and the KV events that confirm what replicas hold.",
    ["datasource", "namespace", "job", "replica"],
    [
        Panel("Index entries per replica", [(f"max by (replica) (kvroute_index_entries{{{TR}}})", "{{replica}}")],
              unit="short", description="Blocks the index attributes to each replica (bounded by its KV capacity)."),
        Panel("Index latency (Redis round trip)",
              [(_q(0.5, "le, op", rrate("kvroute_index_latency_seconds_bucket")), "p50 {{op}}"),
               (_q(0.99, "le, op", rrate("kvroute_index_latency_seconds_bucket")), "p99 {{op}}")],
              unit="s", description="Answered calls to the shared (Redis) index, by operation." + ROUTER_WIDE),
        Panel("Index calls / s", [(f"sum by (op) ({rrate('kvroute_index_latency_seconds_count')})", "{{op}}")],
              unit="ops", description="Answered index calls per second, by operation." + ROUTER_WIDE),
        Panel("Index errors / s by router",
              [(f"sum by (instance, op, kind) ({rrate('kvroute_index_errors_total')})",
                "{{instance}} {{op}} {{kind}}")],
              unit="ops", description="Failed index calls by kind: timeout, connection, error; dropped (write queue "
                                      "full) and unavailable (skipped while Redis fails). Requests are routed without "
                                      "the index meanwhile." + ROUTER_WIDE),
        Panel("KV events applied / s by type",
              [(f"sum by (type) ({rate('kvroute_kv_events_applied_total', TR)})", "{{type}}")], unit="ops",
              description="Events from the replicas' KV-event streams written to the index, by type."),
        Panel("KV events applied / s by replica",
              [(f"sum by (replica) ({rate('kvroute_kv_events_applied_total', TR)})", "{{replica}}")], unit="ops",
              description="Per replica: a replica that serves requests and shows none here has a silent stream."),
        Panel("KV-event streams by state",
              [(f"sum by (state) (max by (replica, state) (kvroute_replica_kv_events_state{{{TR}}}))", "{{state}}")],
              unit="short",
              description="Replicas per state of their KV-event stream (docs/design.md §4.8): following (events "
                          "arrive), pending (nothing heard yet), silent (nothing within events_silent_after_s: "
                          "routed on predictions; the convention port has no publisher, or events are off and "
                          "--fleet.events-port 0 should say so), off (no endpoint)."),
        Panel("KV-event gaps",
              [(f"sum by (replica) (increase(kvroute_kv_event_gaps_total{{{TR}}}[{RI}]))", "{{replica}}")],
              unit="short", description="Sequence gaps: event batches lost between a replica and the router."),
        Panel("KV-event replays and replica restarts",
              [(f"sum by (replica) (increase(kvroute_kv_event_replays_total{{{TR}}}[{RI}]))", "replay {{replica}}"),
               (f"sum by (replica) (increase(kvroute_kv_event_restarts_total{{{TR}}}[{RI}]))", "restart {{replica}}")],
              unit="short",
              description="Replays asked after a gap or at first contact; restarts seen as a sequence going back "
                          "(the replica's confirmed entries are cleared and relearnt)."),
        Panel("KV-event lag",
              [(_q(0.5, "le", rate("kvroute_kv_event_lag_seconds_bucket", TR)), "p50"),
               (_q(0.99, "le, replica", rate("kvroute_kv_event_lag_seconds_bucket", TR)), "p99 {{replica}}")],
              unit="s", description="From the engine's batch timestamp to the router's index write of it: p50 over "
                                    "the selected replicas, p99 per replica."),
        Panel("KV events skipped by reason", [(f"sum by (reason) ({rrate('kvroute_kv_events_skipped_total')})",
                                               "{{reason}}")], unit="ops",
              description="Blocks not applied: undecodable events, bad frames, batches lost while the index was "
                          "unavailable." + ROUTER_WIDE),
        Panel("Discovery errors / s by router and source",
              [(f"sum by (instance, source, error) ({rrate('kvroute_discovery_errors_total')})",
                "{{instance}} {{source}} {{error}}")],
              unit="ops",
              description="Failed calls of a discovery source that talks to an API (the Kubernetes pod watch): "
                          "config, connection, api (an error status), protocol. The router keeps its last "
                          "listing meanwhile, which goes stale (alert KvrouteDiscoveryErrors)." + ROUTER_WIDE),
        Panel("Index availability and rebuilds by router",
              [(f"min by (instance) ({routed('kvroute_index_available{' + T + '}')})", "available {{instance}}"),
               (f"sum by (instance) ({routed(f'increase(kvroute_index_rebuilds_total{{{T}}}[{RI}])')})",
                "rebuilds {{instance}}")],
              unit="short",
              description="Available 0: the router skips a failing Redis until it answers. A rebuild: Redis came "
                          "back empty (restart, flush) and the router registered its replicas again." + ROUTER_WIDE),
    ],
)

DASHBOARDS = {
    "kvroute-fleet.json": FLEET,
    "kvroute-cache.json": CACHE,
    "kvroute-replicas.json": REPLICAS,
    "kvroute-index.json": INDEX,
}


def render(model: dict) -> str:
    return json.dumps(model, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed file is out of date")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    stale = []
    for name, model in DASHBOARDS.items():
        path = args.out / name
        text = render(model)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date (run python dashboards/build.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
