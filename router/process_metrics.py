"""The router's ``process_*`` series (CPU, memory, open files), as one process or as ``--workers N``.

prometheus-client's process collector reads ``/proc/self``, and its multiprocess mode has none.
With workers (router/worker_metrics.py) the worker a scrape reaches reads ``/proc`` of the
supervisor and of every live worker (the pids whose live-gauge files are in
``PROMETHEUS_MULTIPROC_DIR``: the supervisor deletes a dead worker's) and exposes one value per
series under the standard names, so what is written for one process reads the same:

- ``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ``process_virtual_memory_bytes``:
  the sum, what the router as a whole costs its pod (compared with its CPU and memory limits);
- ``process_open_fds`` and ``process_max_fds``: those of the process with the most open files,
  since the open-file limit is per process and that process reaches it first;
- ``process_start_time_seconds``: the earliest, the supervisor's (when the router started).

One series per worker was rejected: a ``pid`` label is new at every restart, and a per-worker
breakdown of CPU or memory is a debugging figure that ``ps`` gives better.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvroute.router.worker_metrics import MULTIPROC_ENV, MULTIPROCESS

_SUMMED = ("process_resident_memory_bytes", "process_virtual_memory_bytes")
_LIVE_FILE = re.compile(r"gauge_live\w+_(\d+)\.db$")
_HELP = {
    "process_cpu_seconds": "CPU seconds, user and system, of the router's processes (supervisor and workers)",
    "process_resident_memory_bytes": "resident memory of the router's processes, summed",
    "process_virtual_memory_bytes": "virtual memory of the router's processes, summed",
    "process_open_fds": "open file descriptors of the router process with the most",
    "process_max_fds": "open-file limit of the router process with the most open file descriptors",
    "process_start_time_seconds": "start time of the router (its earliest process), seconds since the epoch",
}


def live_worker_pids(metrics_dir: str) -> set[int]:
    """Workers alive now: every worker writes a live gauge (``kvroute_router_workers``), whose file
    ``mark_process_dead`` deletes when it dies."""
    pids = set()
    for path in glob.glob(os.path.join(metrics_dir, "gauge_live*_*.db")):
        match = _LIVE_FILE.search(path)
        if match:
            pids.add(int(match.group(1)))
    return pids


def _read(pid: int) -> dict[str, float]:
    """One process's figures by family name; empty if it is gone."""
    collector = ProcessCollector(pid=lambda: pid, registry=None)
    return {family.name: family.samples[0].value for family in collector.collect() if family.samples}


class WorkersProcessCollector(Collector):
    """``process_*`` of the supervisor and its live workers, aggregated as the module says."""

    def __init__(self, metrics_dir: str, supervisor_pid: int):
        self._dir = metrics_dir
        self._supervisor = supervisor_pid

    def pids(self) -> list[int]:
        own = {os.getpid()} | live_worker_pids(self._dir)
        if self._supervisor > 1:  # 1: the supervisor is gone (the worker is draining)
            own.add(self._supervisor)
        return sorted(own)

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        figures = [f for f in map(_read, self.pids()) if f]
        if not figures:
            return
        yield CounterMetricFamily(
            "process_cpu_seconds", _HELP["process_cpu_seconds"], value=sum(f.get("process_cpu_seconds", 0.0) for f in figures)
        )
        for name in _SUMMED:
            yield GaugeMetricFamily(name, _HELP[name], value=sum(f.get(name, 0.0) for f in figures))
        with_fds = [f for f in figures if "process_open_fds" in f]
        if with_fds:
            busiest = max(with_fds, key=lambda f: f["process_open_fds"])
            for name in ("process_open_fds", "process_max_fds"):
                yield GaugeMetricFamily(name, _HELP[name], value=busiest[name])
        starts = [f["process_start_time_seconds"] for f in figures if "process_start_time_seconds" in f]
        if starts:
            yield GaugeMetricFamily("process_start_time_seconds", _HELP["process_start_time_seconds"], value=min(starts))


def register_process_metrics(registry: CollectorRegistry) -> None:
    """One process: the client's own collector on ``registry``.  Workers: nothing here (the
    exposition of the files is built per scrape: ``workers_process_collector``)."""
    if not MULTIPROCESS:
        ProcessCollector(registry=registry)


def workers_process_collector() -> WorkersProcessCollector:
    """For a worker's scrape: the supervisor is its parent."""
    return WorkersProcessCollector(os.environ[MULTIPROC_ENV], os.getppid())
