"""Bytes per entry of the router's bounded caches, and what each holds at its default bound:
``python -m kvroute.bench.cache_costs``.  A soak at the default bounds sees RSS grow while these fill
(hours at 10 req/s); this says how far.  Each cache is filled with N new entries under tracemalloc.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import tracemalloc
from collections.abc import Callable

import numpy as np

from kvroute.replica.assets import TINY_TOKENIZER
from kvroute.router.index.base import ReplicaSpec
from kvroute.router.index.memory import MemoryIndex
from kvroute.router.placement.policy.cost_model import MAX_PREFIX_KEYS, MAX_SESSIONS, SIGNAL_TAU_S, SessionBook
from kvroute.router.placement.policy.prefix_heat import PrefixHeat
from kvroute.router.request.reuse import ReuseTracker
from kvroute.common.tokens import Tokenizer
from kvroute.common.tokens.segments import DEFAULT_CACHE_MAX_CHARS

BLOCKS_PER_PROMPT = 20
MESSAGE = "question {}: how do caches and routers interact, and what do they share? "  # ~75 chars


def traced_bytes(fill: Callable[[], object]) -> int:
    """Bytes still allocated after ``fill()`` (what it returns is kept alive while measuring)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = fill()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    return after - before


def reuse_window(n: int) -> ReuseTracker:
    rng = np.random.default_rng(0)
    tracker = ReuseTracker(window_blocks=n)
    for _ in range(n // BLOCKS_PER_PROMPT):
        ids = rng.integers(0, 30_000, BLOCKS_PER_PROMPT * 16, dtype=np.uint32)
        tracker.observe("m", [random.getrandbits(63) for _ in range(BLOCKS_PER_PROMPT)], ids, 16, 1)
    return tracker


def memory_index(n: int) -> MemoryIndex:
    index = MemoryIndex()
    asyncio.run(index.add_replica(ReplicaSpec(name="r", capacity_blocks=n, publishes_events=False)))
    for _ in range(n // BLOCKS_PER_PROMPT):
        index.record_prediction_now("r", [random.getrandbits(63) for _ in range(BLOCKS_PER_PROMPT)])
    return index


def session_book(n: int) -> SessionBook:
    book = SessionBook(n, 120.0)
    for i in range(n):  # tenant-salted session keys, as the router makes them
        book.touch(f"{i:032x}.session-{i}", "http://10.0.0.1:8000", float(i))
    return book


def prefix_heat(n: int) -> PrefixHeat:
    heat = PrefixHeat(SIGNAL_TAU_S, n)
    for i in range(n):
        heat.record(random.getrandbits(63), float(i))
    return heat


def segment_cache(n: int) -> Tokenizer:
    tok = Tokenizer.from_dir(TINY_TOKENIZER)
    for i in range(n):
        tok.encode(MESSAGE.format(i))
    return tok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvroute.bench.cache_costs", description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=20_000, help="entries per cache")
    n = p.parse_args(argv).n
    message_chars = len(MESSAGE.format(n // 2))
    rows = [
        ("reuse window (per model)", "block", traced_bytes(lambda: reuse_window(n)) / n, 200_000),
        ("memory index (per replica)", "block of KV capacity", traced_bytes(lambda: memory_index(n)) / n, None),
        ("cost_model sessions", "session", traced_bytes(lambda: session_book(n)) / n, MAX_SESSIONS),
        ("cost_model prefix heat", "prefix key", traced_bytes(lambda: prefix_heat(n)) / n, MAX_PREFIX_KEYS),
        ("tokenizer segment cache", f"{message_chars}-char text", traced_bytes(lambda: segment_cache(n)) / n,
         DEFAULT_CACHE_MAX_CHARS // message_chars),
    ]
    print(f"{'cache':<28} {'bytes per entry':>16}  {'entry':<22} {'at its default bound':>20}")
    for name, entry, per, bound in rows:
        at_bound = f"{per * bound / 1e6:.0f} MB" if bound else "x capacity"
        print(f"{name:<28} {per:16.0f}  {entry:<22} {at_bound:>20}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
