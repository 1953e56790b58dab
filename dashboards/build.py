"""Writes the Grafana dashboards of kvroute (``dashboards/*.json``, Grafana's JSON model).

    python dashboards/build.py            # rewrite the JSON files
    python dashboards/build.py --check    # exit 1 if a committed file differs from what this writes

The panels are declared here, once, as data; the JSON files are the output that Grafana's
provisioning (deploy/grafana) and "Import dashboard" read.  Every query names metrics that kvroute
(router/metrics.py, router/kvevents) or vLLM export; tests/test_observe.py evaluates each of them
against a real Prometheus scraping a router under load.

Variables: ``$datasource`` (a Prometheus), ``$model`` (kvroute's ``model`` label, which equals
vLLM's ``model_name``), ``$replica`` (kvroute's ``replica`` label: a replica's base URL).  Engine
panels show vLLM's series by ``instance`` (the scrape target, i.e. the replica's host:port).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | table | bargauge
    description: str = ""
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


VARIABLES = {
    "datasource": {
        "type": "datasource",
        "name": "datasource",
        "label": "Data source",
        "query": "prometheus",
        "current": {},
    },
    "model": _variable("model", "Model", "label_values(kvroute_prompt_tokens_total, model)"),
    "replica": _variable("replica", "Replica", "label_values(kvroute_replica_healthy, replica)"),
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


def _q(q: float, metric: str, by: str, selector: str = "") -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({metric}{selector}[{RI}])))"


M = 'model=~"$model"'
MN = 'model_name=~"$model"'
R = 'replica=~"$replica"'
BREAKER = [{"type": "value", "options": {"0": {"text": "closed", "color": "green"},
                                          "1": {"text": "half-open", "color": "orange"},
                                          "2": {"text": "open", "color": "red"}}}]
HEALTH = [{"type": "value", "options": {"0": {"text": "down", "color": "red"}, "1": {"text": "up", "color": "green"}}}]


def _ratio(num: str, den: str, by: str, sel: str) -> str:
    return f"sum by ({by}) (rate({num}{{{sel}}}[{RI}]))\n  / sum by ({by}) (rate({den}{{{sel}}}[{RI}]))"


FLEET = dashboard(
    "kvroute-fleet",
    "kvroute / Fleet overview",
    "Requests, errors, router-added latency and time to first token across every router.",
    ["datasource", "model"],
    [
        Panel("Requests / s", [(f"sum(rate(kvroute_requests_total{{{M}}}[{RI}]))", "requests/s")],
              unit="reqps", kind="stat", width=6, height=4),
        Panel("5xx ratio", [(f'(sum(rate(kvroute_requests_total{{{M},status=~"5.."}}[{RI}])) or vector(0))\n'
                             f"  / sum(rate(kvroute_requests_total{{{M}}}[{RI}]))", "5xx")],
              unit="percentunit", kind="stat", width=6, height=4),
        Panel("Healthy replicas", [("sum(max by (replica) (kvroute_replica_healthy))", "healthy")],
              kind="stat", width=6, height=4,
              description="Replicas passing health checks (max over routers, so each counts once)."),
        Panel("Requests in flight", [("sum(kvroute_in_flight)", "in flight")], kind="stat", width=6, height=4),
        Panel("Requests by status", [(f"sum by (status) (rate(kvroute_requests_total{{{M}}}[{RI}]))", "{{status}}")],
              unit="reqps"),
        Panel("Requests by model", [(f"sum by (model) (rate(kvroute_requests_total{{{M}}}[{RI}]))", "{{model}}")],
              unit="reqps"),
        Panel("Error ratio by model",
              [(f'(sum by (model) (rate(kvroute_requests_total{{{M},status=~"5.."}}[{RI}]))\n'
                f"  or sum by (model) (rate(kvroute_requests_total{{{M}}}[{RI}])) * 0)\n"
                f"  / sum by (model) (rate(kvroute_requests_total{{{M}}}[{RI}]))", "{{model}}")],
              unit="percentunit", description="Share of the router's answers that are 5xx (0 when there were none)."),
        Panel("Router-added latency",
              [(_q(0.5, "kvroute_router_added_latency_seconds_bucket", "le"), "p50"),
               (_q(0.99, "kvroute_router_added_latency_seconds_bucket", "le"), "p99")],
              unit="s", description="Time in the router before the upstream request is sent: parse, tokenize, "
                                    "hash, index lookup, policy."),
        Panel("TTFT seen by the router",
              [(_q(0.5, "kvroute_ttft_seconds_bucket", "le, model", f"{{{M}}}"), "p50 {{model}}"),
               (_q(0.99, "kvroute_ttft_seconds_bucket", "le, model", f"{{{M}}}"), "p99 {{model}}")],
              unit="s"),
        Panel("TTFT reported by the engines (vLLM)",
              [(_q(0.5, "vllm:time_to_first_token_seconds_bucket", "le, model_name", f"{{{MN}}}"), "p50 {{model_name}}"),
               (_q(0.99, "vllm:time_to_first_token_seconds_bucket", "le, model_name", f"{{{MN}}}"), "p99 {{model_name}}")],
              unit="s"),
        Panel("Routing decisions by reason",
              [(f"sum by (policy, reason) (rate(kvroute_routing_decisions_total[{RI}]))", "{{policy}} {{reason}}")],
              unit="ops", description="cache: the chosen replica holds a prefix; load: none does, least work; "
                                      "balance: the bounded-load rule overrode; session: the session hint kept it; "
                                      "failover: a retry after a failure."),
        Panel("Upstream failures by stage",
              [(f"sum by (stage) (rate(kvroute_upstream_failures_total[{RI}]))", "{{stage}}")],
              unit="ops", description="connect / first_byte failures are retried on another replica; "
                                      "mid_stream ones end the stream with an error event."),
    ],
)

CACHE = dashboard(
    "kvroute-cache",
    "kvroute / Cache",
    "Prefix reuse broken down (docs/design.md §6): available (an infinite shared cache), predicted (what the "
    "router believed the chosen replica held), delivered (what the engine reported cached).",
    ["datasource", "model"],
    [
        Panel("Reuse available",
              [(f"sum(increase(kvroute_reuse_available_tokens_total{{{M}}}[$__range]))\n"
                f"  / sum(increase(kvroute_prompt_tokens_total{{{M}}}[$__range]))", "available")],
              unit="percentunit", kind="stat", width=8, height=4, max=1),
        Panel("Reuse predicted",
              [(f"sum(increase(kvroute_reuse_predicted_tokens_total{{{M}}}[$__range]))\n"
                f"  / sum(increase(kvroute_prompt_tokens_total{{{M}}}[$__range]))", "predicted")],
              unit="percentunit", kind="stat", width=8, height=4, max=1),
        Panel("Reuse delivered",
              [(f"sum(increase(kvroute_reuse_delivered_tokens_total{{{M}}}[$__range]))\n"
                f"  / sum(increase(kvroute_reuse_measured_prompt_tokens_total{{{M}}}[$__range]))", "delivered")],
              unit="percentunit", kind="stat", width=8, height=4, max=1),
        Panel("Reuse per model: available vs predicted vs delivered",
              [(_ratio("kvroute_reuse_available_tokens_total", "kvroute_prompt_tokens_total", "model", M),
                "available {{model}}"),
               (_ratio("kvroute_reuse_predicted_tokens_total", "kvroute_prompt_tokens_total", "model", M),
                "predicted {{model}}"),
               (_ratio("kvroute_reuse_delivered_tokens_total", "kvroute_reuse_measured_prompt_tokens_total", "model", M),
                "delivered {{model}}")],
              unit="percentunit", max=1, width=24, height=9,
              description="Fractions of prompt tokens. Delivered far below available: routing does not follow the "
                          "cache. Predicted above delivered: the index believes blocks the engines evicted."),
        Panel("Delivered / available per model",
              [(f"sum by (model) (rate(kvroute_reuse_delivered_tokens_total{{{M}}}[{RI}]))\n"
                f"  / sum by (model) (rate(kvroute_reuse_available_tokens_total{{{M}}}[{RI}]))", "{{model}}")],
              unit="percentunit", description="How much of the reuse that existed the fleet actually got."),
        Panel("Prompt tokens / s per model",
              [(f"sum by (model) (rate(kvroute_prompt_tokens_total{{{M}}}[{RI}]))", "routed {{model}}"),
               (f"sum by (model) (rate(kvroute_reuse_delivered_tokens_total{{{M}}}[{RI}]))", "cached {{model}}")],
              unit="short"),
        Panel("Engine prefix-cache hit rate per replica",
              [(f"sum by (instance) (rate(vllm:prefix_cache_hits_total{{{MN}}}[{RI}]))\n"
                f"  / sum by (instance) (rate(vllm:prefix_cache_queries_total{{{MN}}}[{RI}]))", "{{instance}}")],
              unit="percentunit", max=1, description="vLLM's own counters: cached tokens over queried tokens."),
        Panel("Cached prompt tokens / s per replica",
              [(f"sum by (instance) (rate(vllm:prefix_cache_hits_total{{{MN}}}[{RI}]))", "{{instance}}")]),
        Panel("Cache-hostile prompts by client",
              [("topk(10, sum by (client) (increase(kvroute_cache_hostile_prompts_total[$__range])))", "{{client}}")],
              kind="bargauge",
              description="Prompts whose first block is new while a long later stretch was seen before (a "
                          "timestamp or user id at the start of the system prompt defeats every prefix cache)."),
        Panel("Cache-hostile prompts / s by client",
              [(f"sum by (client) (rate(kvroute_cache_hostile_prompts_total[{RI}]))", "{{client}}")], unit="ops"),
    ],
)

REPLICAS = dashboard(
    "kvroute-replicas",
    "kvroute / Replicas",
    "Per-replica load, health and routing share, from the routers (kvroute_replica_*) and the engines (vllm:*).",
    ["datasource", "model", "replica"],
    [
        Panel("Health (router's checks)", [(f"max by (replica) (kvroute_replica_healthy{{{R}}})", "{{replica}}")],
              mappings=HEALTH, max=1),
        Panel("Circuit breaker", [(f"max by (replica) (kvroute_replica_breaker_state{{{R}}})", "{{replica}}")],
              mappings=BREAKER, max=2, description="0 closed, 1 half-open, 2 open (worst over routers)."),
        Panel("Routing share",
              [(f'sum by (replica) (rate(kvroute_requests_total{{{M},{R},replica!="none"}}[{RI}]))\n'
                f'  / ignoring (replica) group_left () sum(rate(kvroute_requests_total{{{M},replica!="none"}}[{RI}]))',
                "{{replica}}")],
              unit="percentunit", max=1, description="Each replica's share of the routed requests (all routers)."),
        Panel("Router in-flight per replica", [(f"sum by (replica) (kvroute_replica_in_flight{{{R}}})", "{{replica}}")]),
        Panel("Queued prefill tokens (router's view)",
              [(f"sum by (replica) (kvroute_replica_queued_prefill_tokens{{{R}}})", "{{replica}}")],
              description="Uncached prompt tokens sent to the replica whose first token has not come back."),
        Panel("Learned prefill rate", [(f"avg by (replica) (kvroute_replica_prefill_rate{{{R}}})", "{{replica}}")],
              unit="short", description="Prompt tokens per second, learned from observed TTFTs (cost model)."),
        Panel("Engine: running requests", [(f"sum by (instance) (vllm:num_requests_running{{{MN}}})", "{{instance}}")]),
        Panel("Engine: waiting requests", [(f"sum by (instance) (vllm:num_requests_waiting{{{MN}}})", "{{instance}}")]),
        Panel("Engine: KV-cache usage", [(f"max by (instance) (vllm:kv_cache_usage_perc{{{MN}}})", "{{instance}}")],
              unit="percentunit", max=1),
        Panel("Engine: TTFT p99 per replica",
              [(_q(0.99, "vllm:time_to_first_token_seconds_bucket", "le, instance", f"{{{MN}}}"), "{{instance}}")],
              unit="s"),
        Panel("Upstream failures by replica",
              [(f"sum by (replica, stage) (rate(kvroute_upstream_failures_total{{{R}}}[{RI}]))", "{{replica}} {{stage}}")],
              unit="ops"),
        Panel("Engine cache configuration",
              [(f"max by (instance, model_name, block_size, num_gpu_blocks, prefix_caching_hash_algo) "
                f"(vllm:cache_config_info{{{MN}}})", "")],
              kind="table", description="Block size and KV capacity each engine reports (the router reads them too)."),
    ],
)

INDEX = dashboard(
    "kvroute-index",
    "kvroute / Index",
    "The prefix index: entries, Redis latency and errors, and the KV events that confirm what replicas hold.",
    ["datasource", "replica"],
    [
        Panel("Index entries per replica", [(f"max by (replica) (kvroute_index_entries{{{R}}})", "{{replica}}")],
              description="Blocks the index attributes to each replica (bounded by its KV capacity)."),
        Panel("Index latency (Redis round trip)",
              [(_q(0.5, "kvroute_index_latency_seconds_bucket", "le, op"), "p50 {{op}}"),
               (_q(0.99, "kvroute_index_latency_seconds_bucket", "le, op"), "p99 {{op}}")],
              unit="s"),
        Panel("Index calls / s", [(f"sum by (op) (rate(kvroute_index_latency_seconds_count[{RI}]))", "{{op}}")],
              unit="ops"),
        Panel("Index errors / s by router",
              [(f"sum by (instance, op, kind) (rate(kvroute_index_errors_total[{RI}]))", "{{instance}} {{op}} {{kind}}")],
              unit="ops", description="Failed index calls by kind: timeout, connection, error; dropped (write queue "
                                      "full) and unavailable (skipped while Redis fails). Requests are routed without "
                                      "the index meanwhile."),
        Panel("KV events applied / s by type",
              [(f"sum by (type) (rate(kvroute_kv_events_applied_total[{RI}]))", "{{type}}")], unit="ops"),
        Panel("KV events applied / s by replica",
              [(f"sum by (replica) (rate(kvroute_kv_events_applied_total{{{R}}}[{RI}]))", "{{replica}}")], unit="ops"),
        Panel("KV-event gaps", [(f"sum by (replica) (increase(kvroute_kv_event_gaps_total{{{R}}}[{RI}]))", "{{replica}}")],
              description="Sequence gaps: event batches lost between a replica and the router."),
        Panel("KV-event replays and replica restarts",
              [(f"sum by (replica) (increase(kvroute_kv_event_replays_total{{{R}}}[{RI}]))", "replay {{replica}}"),
               (f"sum by (replica) (increase(kvroute_kv_event_restarts_total{{{R}}}[{RI}]))", "restart {{replica}}")],
              description="Replays asked after a gap or at first contact; restarts seen as a sequence going back "
                          "(the replica's confirmed entries are cleared and relearnt)."),
        Panel("KV-event lag",
              [(_q(0.5, "kvroute_kv_event_lag_seconds_bucket", "le"), "p50"),
               (_q(0.99, "kvroute_kv_event_lag_seconds_bucket", "le"), "p99")],
              unit="s", description="From the engine's batch timestamp to the router applying it."),
        Panel("KV events skipped by reason", [(f"sum by (reason) (rate(kvroute_kv_events_skipped_total[{RI}]))",
                                               "{{reason}}")], unit="ops"),
        Panel("Index availability and rebuilds by router",
              [("min by (instance) (kvroute_index_available)", "available {{instance}}"),
               (f"sum by (instance) (increase(kvroute_index_rebuilds_total[{RI}]))", "rebuilds {{instance}}")],
              description="Available 0: the router skips a failing Redis until it answers. A rebuild: Redis came "
                          "back empty (restart, flush) and the router registered its replicas again."),
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
