"""The engines' prefix-cache counters re-exported by the router (router/fleet/engine_counters.py), next to its
own delivered figure: deltas over the window the router watched, restarts, replicas leaving."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from kvroute.router.fleet.breaker import CircuitBreaker
from kvroute.router.fleet.replica import Replica
from kvroute.router.fleet.engine_counters import HITS, QUERIES, EngineCacheCounters
from kvroute.common.scrape import ScrapeResult
from tests.router_support import MODEL, emulated_replicas, openai_client, running_router, scrape, total, label

NAME = "http://10.0.0.1:8000"


def replica(name: str = NAME) -> Replica:
    return Replica(name=name, url=name, breaker=CircuitBreaker(3, 5.0))


def scraped(queries: float, hits: float, started: float | None = 1000.0) -> ScrapeResult:
    return ScrapeResult(counters={QUERIES: queries, HITS: hits}, process_start_time=started)


def exported(registry: CollectorRegistry, kind: str, name: str = NAME) -> float | None:
    return registry.get_sample_value(f"kvroute_replica_prefix_cache_{kind}_tokens_total", {"replica": name})


def test_the_first_scrape_is_a_baseline_and_later_ones_add_their_growth() -> None:
    registry = CollectorRegistry()
    counters = EngineCacheCounters(registry)
    r = replica()
    counters.observe(r, scraped(5000, 1200))  # counted before this router watched: not ours
    assert (exported(registry, "queries"), exported(registry, "hits")) == (0.0, 0.0)
    counters.observe(r, scraped(5600, 1500))
    counters.observe(r, scraped(5600, 1500))  # no traffic between two scrapes
    counters.observe(r, scraped(6000, 1500))
    assert (exported(registry, "queries"), exported(registry, "hits")) == (1000.0, 300.0)


def test_a_restart_counts_the_new_process_from_zero() -> None:
    registry = CollectorRegistry()
    counters = EngineCacheCounters(registry)
    r = replica()
    counters.observe(r, scraped(5000, 1200))
    counters.observe(r, scraped(5100, 1250))
    counters.observe(r, scraped(300, 40, started=2000.0))  # a new process: its counters restart
    assert (exported(registry, "queries"), exported(registry, "hits")) == (400.0, 90.0)
    # A new start time with counters that happen to be higher still means a new process.
    counters.observe(r, scraped(9000, 100, started=3000.0))
    assert (exported(registry, "queries"), exported(registry, "hits")) == (9400.0, 190.0)


def test_replicas_without_the_counters_and_replicas_that_leave() -> None:
    registry = CollectorRegistry()
    counters = EngineCacheCounters(registry)
    other = replica("http://10.0.0.2:8000")
    counters.observe(other, ScrapeResult())  # no vllm:prefix_cache_* on its page: nothing exported
    assert exported(registry, "queries", other.name) is None
    r = replica()
    counters.observe(r, scraped(10, 0))
    counters.observe(r, scraped(20, 5))
    counters.on_fleet_event("left", r)
    assert exported(registry, "queries") is None
    counters.observe(r, scraped(50, 9))  # back: a fresh baseline
    assert exported(registry, "queries") == 0.0


async def test_the_router_exports_what_the_engines_counted_next_to_its_delivered_figure() -> None:
    async with emulated_replicas(2) as reps:
        async with running_router([r.url for r in reps], fleet={"metrics_interval_s": 0.05}) as app:
            before = await scrape(app.url)
            client = openai_client(app)
            messages = [{"role": "system", "content": "You index the fleet. " * 40},
                        {"role": "user", "content": "Which replica holds the prefix?"}]
            usages = []
            for _ in range(4):
                answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
                usages.append(answer.usage)
            engines = {r.url: (r.engine.prefix_cache_queries, r.engine.prefix_cache_hits) for r in reps}
            sent = sum(u.prompt_tokens for u in usages)
            # vLLM leaves prompt_tokens_details null when nothing was cached
            delivered = sum(u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0 for u in usages)
            assert delivered > 0 and sum(q for q, _ in engines.values()) == sent

            def grown(samples: dict, kind: str, url: str) -> float:
                name = f"kvroute_replica_prefix_cache_{kind}_tokens_total"
                return total(samples, name, replica=label(url)) - total(before, name, replica=label(url))

            deadline = time.monotonic() + 5
            while True:  # equal once the fleet has scraped the replicas again
                now = await scrape(app.url)
                if all((grown(now, "queries", u), grown(now, "hits", u)) == engines[u] for u in engines):
                    break
                assert time.monotonic() < deadline, (now, engines)
                await asyncio.sleep(0.05)
            delivered_by_router = total(now, "kvroute_reuse_delivered_tokens_total", model=MODEL) - total(
                before, "kvroute_reuse_delivered_tokens_total", model=MODEL
            )
            assert delivered_by_router == delivered == sum(h for _, h in engines.values())
