"""Read a vLLM replica's load and cache geometry from its Prometheus ``/metrics`` text.

vLLM labels its series with ``model_name`` and ``engine`` (one engine per data-parallel rank), so
gauges are combined per model: request counts summed over engines, KV usage as the fullest engine.
Counters arrive with the ``_total`` suffix on the wire; both spellings are accepted.  Any metric
may be missing (an older vLLM, an emulated replica, a proxy in between): its field stays at zero
or None rather than failing the scrape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_V0 = "vllm:gpu_cache_usage_perc"  # the name before vLLM's V1 engine
CACHE_CONFIG = "vllm:cache_config_info"
PROCESS_START = "process_start_time_seconds"
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
)

_GAUGES = {RUNNING, WAITING, KV_USAGE, KV_USAGE_V0, CACHE_CONFIG, PROCESS_START}
# Sample names worth parsing; everything else (histogram buckets are most of a real page) is
# skipped before the parser sees it, which keeps a scrape far below a millisecond.
_WANTED = _GAUGES | set(COUNTERS) | {c + "_total" for c in COUNTERS}


@dataclass
class ModelLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1, the fullest engine's


@dataclass
class ScrapeResult:
    running: int = 0  # summed over models and engines
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1, the fullest engine's
    per_model: dict[str, ModelLoad] = field(default_factory=dict)
    block_size: int | None = None  # from vllm:cache_config_info
    capacity_blocks: int | None = None  # num_gpu_blocks summed over engines (each DP rank has its own cache)
    engines: int = 0  # engines reporting a cache config
    process_start_time: float | None = None  # changes when the replica process restarts
    counters: dict[str, float] = field(default_factory=dict)  # name without _total -> sum


def _label_int(labels: dict[str, str], key: str) -> int | None:
    raw = labels.get(key)
    try:
        value = int(float(raw)) if raw is not None else None
    except ValueError:  # vLLM prints "None" for unset config fields
        return None
    return value if value is not None and value > 0 else None


_WANTED_PREFIXES = tuple(sorted(_WANTED))


def _wanted_lines(text: str) -> str:
    keep = []
    for line in text.splitlines():
        # startswith is a cheap first cut (comments never match); the exact name check follows.
        if line.startswith(_WANTED_PREFIXES) and line.split("{", 1)[0].split(" ", 1)[0] in _WANTED:
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse_vllm_metrics(text: str) -> ScrapeResult:
    """Parse a ``/metrics`` page.  Raises ValueError on text that is not Prometheus format."""
    result = ScrapeResult()
    engine_blocks: dict[str, int] = {}
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if math.isnan(value):
                continue
            if name == CACHE_CONFIG:
                if result.block_size is None:
                    result.block_size = _label_int(labels, "block_size")
                blocks = _label_int(labels, "num_gpu_blocks")
                if blocks is not None:
                    engine_blocks[labels.get("engine", "")] = blocks
                result.engines += 1
            elif name == PROCESS_START:
                result.process_start_time = value
            elif name in (RUNNING, WAITING, KV_USAGE, KV_USAGE_V0):
                model = result.per_model.setdefault(labels.get("model_name", ""), ModelLoad())
                if name == RUNNING:
                    model.running += int(value)
                elif name == WAITING:
                    model.waiting += int(value)
                else:  # either spelling; a replica exports one of them
                    model.kv_usage = max(model.kv_usage, value)
            else:
                key = name.removesuffix("_total")
                result.counters[key] = result.counters.get(key, 0.0) + value
    if engine_blocks:
        result.capacity_blocks = sum(engine_blocks.values())
    for model in result.per_model.values():
        result.running += model.running
        result.waiting += model.waiting
        result.kv_usage = max(result.kv_usage, model.kv_usage)
    return result
