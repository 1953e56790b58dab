"""Prefix-index speed and Redis memory: `python -m kvroute.bench.index_bench [--redis-url URL]`.

Lookup: a 512-block chain over 8 replicas, replica i holding its first 64·(i+1) blocks, with the
entries confirmed (the steady state of replicas with KV events), predicted on replicas without
events (never expire) and predicted on replicas with events (expire; not yet confirmed).
Writes: a fresh 512-block chain predicted on a replica whose capacity is already full (so each
write also evicts 512 entries), the same chain predicted again (a renewal), and a fresh chain
predicted then confirmed (one request plus its BlockStored events).
Shared chain (memory backend only): a 400-block chain held whole by 1, 4 and 16 replicas (a hot
conversation), among 200 other chains; ``lookup_now`` of it, and ``record_prediction_now`` of it
plus 4 new blocks on one holder (the next turn: 400 blocks touched, 4 added), for replicas with
KV events (TTL predictions) and without (predictions that never expire).
Memory: N entries written under the bench's own key prefix, MEMORY USAGE summed over its keys
and divided by N, for confirmed entries, TTL predictions and predictions that never expire.
All keys are deleted afterwards; the shared server is never flushed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from kvroute.router.index import MemoryIndex, PrefixIndex, RedisIndex, ReplicaSpec

from kvroute.bench.timing import per_call_us

CHAIN_BLOCKS = 512
REPLICAS = 8
SHARED_BLOCKS = 400
SHARED_HOLDERS = (1, 4, 16)


def random_chain(rng: random.Random, n: int = CHAIN_BLOCKS) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


async def timed(call: Callable[[], Awaitable[object]], repeat: int) -> tuple[float, float]:
    """Median and p99 of one awaited call, in microseconds."""
    for _ in range(min(100, repeat)):
        await call()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        await call()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]


async def fill_prefixes(index: PrefixIndex, chain: list[int], state: str, tag: str) -> None:
    """8 replicas, replica i holding the first 64·(i+1) blocks of ``chain`` in the given state."""
    for i in range(REPLICAS):
        name, depth = f"{tag}-{i}", CHAIN_BLOCKS * (i + 1) // REPLICAS
        await index.add_replica(ReplicaSpec(name, 100_000, publishes_events=state != "pinned"))
        if state == "confirmed":
            await index.confirm(name, chain[:depth])
        else:
            await index.record_prediction(name, chain[:depth])


async def speed(index: PrefixIndex, repeat: int) -> dict[str, tuple[float, float]]:
    rng = random.Random(0)
    out = {}
    for state, label in (("confirmed", "confirmed"), ("pinned", "predicted, no TTL"), ("expiring", "predicted, TTL")):
        chain = random_chain(rng)
        await fill_prefixes(index, chain, state, tag=state)
        depths = await index.lookup(chain)
        assert sorted(depths.values()) == [CHAIN_BLOCKS * (i + 1) // REPLICAS for i in range(REPLICAS)], depths
        out[f"lookup 512 blocks x 8 replicas ({label})"] = await timed(lambda c=chain: index.lookup(c), repeat)

    full = ReplicaSpec("full", 4 * CHAIN_BLOCKS, publishes_events=True)
    await index.add_replica(full)
    for _ in range(4):
        await index.record_prediction(full.name, random_chain(rng))
    fresh = [random_chain(rng) for _ in range(2 * repeat + 200)]
    out["record_prediction 512, new (evicts 512)"] = await timed(
        lambda: index.record_prediction(full.name, fresh.pop()), repeat
    )
    out["record_prediction 512, renewal"] = await timed(lambda: index.record_prediction("expiring-7", chain), repeat)

    async def predict_then_confirm() -> None:  # what one request and its KV events cost
        new = fresh.pop()
        await index.record_prediction(full.name, new)
        await index.confirm(full.name, new)

    out["record_prediction + confirm 512, new"] = await timed(predict_then_confirm, repeat)
    return out


async def shared_chain(repeat: int) -> dict[str, tuple[float, float]]:
    """One hot chain held whole by several replicas: what a lookup and the next turn's write cost."""
    rng = random.Random(2)
    out = {}
    for events, label in ((True, "TTL"), (False, "no TTL")):
        for holders in SHARED_HOLDERS:
            index = MemoryIndex()
            names = [f"r{i}" for i in range(holders)]
            for name in names:
                await index.add_replica(ReplicaSpec(name, 1_000_000, publishes_events=events))
            for i in range(200):  # other conversations: the maps are not tiny
                index.record_prediction_now(names[i % holders], random_chain(rng, SHARED_BLOCKS))
            chain = random_chain(rng, SHARED_BLOCKS)
            for name in names:
                index.record_prediction_now(name, chain)
            assert index.lookup_now(chain) == dict.fromkeys(names, SHARED_BLOCKS)
            case = f"{SHARED_BLOCKS} blocks held by {holders:>2} ({label})"
            out[f"lookup_now, {case}"] = per_call_us(lambda c=chain, i=index: i.lookup_now(c), repeat)
            turns = iter([chain + random_chain(rng, 4) for _ in range(repeat + 200)])
            out[f"record_prediction_now +4, {case}"] = per_call_us(
                lambda t=turns, i=index: i.record_prediction_now("r0", next(t)), repeat
            )
    return out


async def keys_under(client: aioredis.Redis, prefix: str) -> list[bytes]:
    return [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]


async def bytes_per_entry(client: aioredis.Redis, prefix: str, kind: str, entries: int) -> float:
    """Redis memory per entry of one kind, measured by MEMORY USAGE over the index's own keys."""
    index = RedisIndex(client, key_prefix=prefix, predicted_ttl_s=3600)
    await index.add_replica(ReplicaSpec("r", entries, publishes_events=kind != "pinned prediction"))
    rng = random.Random(1)
    for _ in range(entries // CHAIN_BLOCKS):
        chain = random_chain(rng)
        if kind == "confirmed":
            await index.confirm("r", chain)
        else:
            await index.record_prediction("r", chain)
    assert await index.entry_count("r") == entries
    total = 0
    for key in await keys_under(client, prefix):
        total += await client.memory_usage(key, samples=0) or 0
    return total / entries


async def run_redis(url: str, repeat: int, entries: int) -> tuple[dict, dict[str, float]]:
    client = aioredis.Redis.from_url(url)
    prefix = f"kvroute-bench-{uuid.uuid4().hex[:12]}"
    try:
        timings = await speed(RedisIndex(client, key_prefix=f"{prefix}-speed"), repeat)
        memory = {}
        for kind in ("confirmed", "TTL prediction", "pinned prediction"):
            sub = f"{prefix}-mem-{kind.split()[0]}"
            memory[kind] = await bytes_per_entry(client, sub, kind, entries)
            await client.delete(*await keys_under(client, sub))
        return timings, memory
    finally:
        leftover = await keys_under(client, prefix)
        if leftover:
            await client.delete(*leftover)
        await client.aclose()


async def main_async(args: argparse.Namespace) -> None:
    print(f"{'memory backend, synchronous calls':<60}{'p50 us':>10}{'p99 us':>10}")
    for op, (p50, p99) in (await shared_chain(args.repeat)).items():
        print(f"{op:<60}{p50:>10.1f}{p99:>10.1f}")
    print()
    rows = {"memory": await speed(MemoryIndex(), args.repeat)}
    rows["redis"], memory = await run_redis(args.redis_url, args.repeat, args.entries)
    print(f"{'operation':<52}{'backend':<9}{'p50 us':>10}{'p99 us':>10}")
    for op in rows["memory"]:
        for backend, timings in rows.items():
            p50, p99 = timings[op]
            print(f"{op:<52}{backend:<9}{p50:>10.1f}{p99:>10.1f}")
    print(f"\nRedis memory per entry ({args.entries} entries on one replica, MEMORY USAGE of all keys):")
    for kind, per_entry in memory.items():
        print(f"  {kind:<20}{per_entry:7.1f} bytes")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--entries", type=int, default=CHAIN_BLOCKS * 200)
    args = ap.parse_args(argv)
    try:
        import uvloop  # the router runs on uvloop: measure the client the way it is used
    except ImportError:
        asyncio.run(main_async(args))
    else:
        uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
