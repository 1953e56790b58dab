"""What grows in the router under the soak's traffic: ``python -m kvroute.bench.mem_growth``.

The router runs in this process under tracemalloc (the replicas in children, as in bench/soak.py);
after a warm-up the allocations still live are snapshotted twice, ``--interval-s`` apart, and the
lines whose live memory grew most in between are printed, then the top tracebacks.  The load is
sent from this process too (bench/soak.py's lines are its results).  What grows steadily is a
cache filling toward its bound (bench/cache_costs.py says how far) or a map without one.  At
10 req/s with the defaults: the reuse window, the tokenizer's segment cache, the in-memory index
(and the chain hashes those two hold), cost_model's sessions: all bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tracemalloc

from kvroute.bench.processes import spawn, stop_all
from kvroute.bench.soak import MODEL, SMALL_BOUNDS, SMALL_BOUNDS_REPLICA, TEXTS, TOKENIZER, drive

FRAMES = 8


async def run(args: argparse.Namespace) -> None:
    from kvroute.router.app import RouterApp
    from kvroute.router.config import RouterSettings

    py = sys.executable
    small = args.cache_bounds == "small"
    procs, urls = [], []
    try:
        for _ in range(args.replicas):
            proc, url = await spawn([py, "-m", "kvroute.cli", "replica", "--engine", "emulated", "--port", "0",
                                     "--model", MODEL, "--time-scale", "0.05", "--log-level", "WARNING",
                                     *(SMALL_BOUNDS_REPLICA if small else [])])
            procs.append(proc)
            urls.append(url)
        settings = RouterSettings(host="127.0.0.1", port=0, replicas=urls, tokenizer=str(TOKENIZER),
                                  policy="cost_model", log_level="warning", **(SMALL_BOUNDS if small else {}))
        async with RouterApp(settings) as app:
            results: list = []
            load = asyncio.create_task(drive(app.url, args.rate, args.warmup_s + 2 * args.interval_s + 5, results,
                                              TEXTS if small else None))
            await asyncio.sleep(args.warmup_s)
            gc.collect()
            first = tracemalloc.take_snapshot()
            await asyncio.sleep(args.interval_s)
            gc.collect()
            second = tracemalloc.take_snapshot()
            load.cancel()
            print(f"{len(results)} requests; live allocations that grew in {args.interval_s:g} s, by line:", flush=True)
            for stat in second.compare_to(first, "lineno")[: args.top]:
                print(f"  +{stat.size_diff / 1024:8.1f} KiB {stat.count_diff:+7d} blocks  {stat.traceback[0]}")
            # where the top lines were called from: the growth's owner is further up
            for stat in second.compare_to(first, "traceback")[: args.top // 2]:
                print(f"\n+{stat.size_diff / 1024:.1f} KiB:")
                for line in stat.traceback.format(limit=FRAMES, most_recent_first=True)[::2]:
                    print("   ", line.strip())
    finally:
        await stop_all(procs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvroute.bench.mem_growth", description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--interval-s", type=float, default=90.0)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--cache-bounds", choices=("default", "small"), default="default",
                   help="small: as make soak's (bench/soak.py), to see what grows once the caches are full")
    args = p.parse_args(argv)
    tracemalloc.start(FRAMES)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
