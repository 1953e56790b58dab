"""KV-event subscriber speed: `python -m kvroute.bench.event_bench [--redis URL] [--json]`.

1. decode: one batch holding a BlockStored of ``--blocks`` blocks (vLLM's map events, and the
   positional form of vLLM <= 0.23), and a BlockRemoved batch: microseconds per batch.
2. translate: the router's hashes of that BlockStored (parent lookup, xxh3 chain, map update).
3. throughput: a real publisher (the emulated replica's, ZMQ on loopback) sends ``--batches``
   steady-state batches, each storing ``--blocks`` new blocks and removing as many old ones (a
   full cache evicting), as fast as it can; the subscriber applies them to the index.  Events
   and blocks applied per second, from the first publish to the last batch's index writes.
4. lag: batches paced at ``--rate`` per second; publish -> index writes done, per batch.

Publisher and subscriber share one process and event loop (as a replica and a router would not),
so the figures include the publisher's own cost.  The Redis parts use keys under a unique prefix,
deleted afterwards; they are skipped if Redis does not answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from typing import Any

import msgspec

from kvroute.replica.emulated.publisher import BlockRemoved, BlockStored, KVEventPublisher
from kvroute.bench.timing import per_call_us
from kvroute.router.index import IndexClient, MemoryIndex, RedisIndex, ReplicaSpec
from kvroute.router.index.base import PrefixIndex
from kvroute.router.fleet.kvevents import BatchDecoder, ChainTranslator, KVEventSubscriber

MODEL = "bench-model"
BS = 16
NAME = "bench-replica"


def _stored(hashes: list[int], parent: int | None, first_token: int) -> BlockStored:
    n = len(hashes)
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=list(range(first_token, first_token + n * BS)), block_size=BS, lora_id=None,
                       medium="GPU", lora_name=None, extra_keys=[None] * n, group_idx=0,
                       kv_cache_spec_kind="full_attention")


def _removed(hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=0)


def bench_decode(blocks: int, repeat: int) -> dict[str, Any]:
    enc = msgspec.msgpack.Encoder()
    ev = _stored(list(range(1, blocks + 1)), None, 30_000)  # ids of a 128k vocabulary take 3 bytes
    map_payload = enc.encode([time.time(), [ev], 0])
    legacy_event = ["BlockStored", ev.block_hashes, None, ev.token_ids, BS, None, "GPU"]
    legacy_payload = enc.encode([time.time(), [legacy_event], 0])
    removed_payload = enc.encode([time.time(), [_removed(list(range(1, blocks + 1)))], 0])
    out: dict[str, Any] = {"blocks_per_event": blocks, "payload_bytes": len(map_payload)}
    for label, payload, form in (("stored_map", map_payload, "map"), ("stored_legacy", legacy_payload, "array"),
                                 ("removed_map", removed_payload, "map")):
        decoder = BatchDecoder(form)  # type: ignore[arg-type]
        p50, p99 = per_call_us(lambda d=decoder, p=payload: d.decode(p), repeat)
        out[label] = {"p50_us": round(p50, 2), "p99_us": round(p99, 2)}
    return out


def bench_translate(blocks: int, repeat: int) -> dict[str, Any]:
    decoded = BatchDecoder().decode(msgspec.msgpack.encode([0.0, [_stored(list(range(1, blocks + 1)), None, 30_000)], 0]))
    ev = decoded.events[0]
    t = ChainTranslator(MODEL, capacity_blocks=1 << 16)

    def skip(reason: str, n: int) -> None:
        raise AssertionError(reason)

    p50, p99 = per_call_us(lambda: t.stored(ev, BS, skip), repeat)  # type: ignore[arg-type]
    return {"stored_p50_us": round(p50, 2), "stored_p99_us": round(p99, 2),
            "per_block_p50_us": round(p50 / blocks, 3)}


class _Steady:
    """Batches of a full cache: each stores ``blocks`` new blocks (one growing chain) and evicts
    the ``blocks`` stored ``window`` batches earlier."""

    def __init__(self, blocks: int, window: int = 8):
        self.blocks = blocks
        self.window = window
        self.next_hash = 3_000  # token ids follow the hashes: realistic 3-byte ids
        self.parent: int | None = None
        self.history: list[list[int]] = []

    def batch(self) -> list[Any]:
        hashes = list(range(self.next_hash, self.next_hash + self.blocks))
        events: list[Any] = [_stored(hashes, self.parent, self.next_hash * BS)]
        self.next_hash += self.blocks
        self.parent = hashes[-1]
        self.history.append(hashes)
        if len(self.history) > self.window:
            events.append(_removed(self.history.pop(0)))
        return events


async def _follow(index: PrefixIndex, capacity: int):
    await index.add_replica(ReplicaSpec(NAME, capacity, publishes_events=True))
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", buffer_steps=100_000)
    await pub.start()
    sub = KVEventSubscriber(IndexClient(index), block_size_for=lambda m: BS)
    await sub.start()
    sub.watch(NAME, pub.endpoint, pub.replay_endpoint, MODEL, capacity_blocks=capacity)
    await sub.wait_synced(NAME)
    # one batch through first: the SUB's subscription has reached the PUB from then on
    seq = pub.publish([])
    await sub.wait_applied(NAME, seq, 30)
    return pub, sub


async def bench_throughput(index: PrefixIndex, batches: int, blocks: int) -> dict[str, Any]:
    gen = _Steady(blocks)
    capacity = blocks * (gen.window + 2)
    pub, sub = await _follow(index, capacity)
    try:
        t0 = time.perf_counter()
        seq = 0
        for i in range(batches):
            seq = pub.publish(gen.batch())
            if i % 64 == 63:
                await asyncio.sleep(0)  # let the subscriber read while we publish
        await sub.wait_applied(NAME, seq, 120)
        elapsed = time.perf_counter() - t0
        st = sub.status(NAME)
        assert st is not None and st.gaps == 0, "batches were lost: throughput would be meaningless"
        events = batches * 2 - gen.window
        return {"batches": batches, "events": events, "seconds": round(elapsed, 3),
                "events_per_s": round(events / elapsed), "blocks_per_s": round(events * blocks / elapsed),
                "batches_per_s": round(batches / elapsed)}
    finally:
        await sub.stop()
        await pub.close()


async def bench_lag(index: PrefixIndex, rate: float, seconds: float, blocks: int) -> dict[str, Any]:
    gen = _Steady(blocks)
    pub, sub = await _follow(index, blocks * (gen.window + 2))
    lags: list[float] = []
    try:
        period = 1.0 / rate
        start = time.perf_counter()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i * period - time.perf_counter()))
            t0 = time.perf_counter()
            seq = pub.publish(gen.batch())
            await sub.wait_applied(NAME, seq, 30)
            lags.append((time.perf_counter() - t0) * 1e3)
    finally:
        await sub.stop()
        await pub.close()
    lags.sort()
    return {"rate_per_s": rate, "batches": len(lags), "p50_ms": round(statistics.median(lags), 3),
            "p99_ms": round(lags[int(0.99 * (len(lags) - 1))], 3), "max_ms": round(lags[-1], 3)}


async def _redis_index(url: str) -> tuple[RedisIndex, str] | None:
    import redis.asyncio as aioredis

    prefix = f"kvroute-bench-{uuid.uuid4().hex[:8]}"
    index = RedisIndex(aioredis.Redis.from_url(url, socket_connect_timeout=2), key_prefix=prefix)
    try:
        await index.client.ping()
    except (aioredis.RedisError, OSError):
        await index.client.aclose()
        return None
    return index, prefix


async def _drop_keys(index: RedisIndex, prefix: str) -> None:
    keys = [k async for k in index.client.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await index.client.delete(*keys)
    await index.client.aclose()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "decode": bench_decode(args.blocks, args.repeat),
        "translate": bench_translate(args.blocks, args.repeat),
        "memory": {
            "throughput": await bench_throughput(MemoryIndex(), args.batches, args.blocks),
            "lag": await bench_lag(MemoryIndex(), args.rate, args.seconds, args.blocks),
        },
    }
    made = await _redis_index(args.redis)
    if made is None:
        report["redis"] = f"skipped: no Redis at {args.redis}"
    else:
        index, prefix = made
        try:
            report["redis"] = {
                "throughput": await bench_throughput(index, args.batches, args.blocks),
                "lag": await bench_lag(index, args.rate, args.seconds, args.blocks),
            }
        finally:
            await _drop_keys(index, prefix)
    return report


def _print(report: dict[str, Any]) -> None:
    d = report["decode"]
    print(f"decode, one BlockStored of {d['blocks_per_event']} blocks ({d['payload_bytes']} bytes):")
    for key in ("stored_map", "stored_legacy", "removed_map"):
        print(f"  {key:<14} p50 {d[key]['p50_us']:8.1f} us   p99 {d[key]['p99_us']:8.1f} us")
    t = report["translate"]
    print(f"translate (router hashes): p50 {t['stored_p50_us']:.1f} us, {t['per_block_p50_us']:.2f} us/block")
    for backend in ("memory", "redis"):
        part = report[backend]
        if isinstance(part, str):
            print(f"{backend}: {part}")
            continue
        tp, lag = part["throughput"], part["lag"]
        print(f"{backend} index: {tp['events_per_s']:,} events/s ({tp['blocks_per_s']:,} blocks/s, "
              f"{tp['batches_per_s']:,} batches/s over {tp['batches']} batches)")
        print(f"  lag at {lag['rate_per_s']:.0f} batches/s: p50 {lag['p50_ms']:.2f} ms, p99 {lag['p99_ms']:.2f} ms,"
              f" max {lag['max_ms']:.2f} ms")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=32, help="blocks per BlockStored (32 = a 512-token prompt)")
    ap.add_argument("--repeat", type=int, default=3000, help="calls per decode/translate measurement")
    ap.add_argument("--batches", type=int, default=5000, help="batches in the throughput run")
    ap.add_argument("--rate", type=float, default=200.0, help="batches per second in the lag run")
    ap.add_argument("--seconds", type=float, default=2.0, help="length of the lag run")
    ap.add_argument("--redis", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    report = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)


if __name__ == "__main__":
    main()
