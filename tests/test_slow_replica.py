"""A degraded replica does not hold sessions hostage.

Three emulated replicas behind the real router, one serving 10x slower than the others but
healthy (a degraded GPU, a noisy neighbour); 24 chat sessions of 8 turns each, ~2.4k tokens of
history, 6 in flight.  Staying on the slow replica is cheaper for one turn (the history is cached
there), moving is cheaper for the turns a session has left: after its first few answers show the
replica slow, sessions leave it and new ones do not land there.  (Before, it kept the same share
of the requests from the first turns to the last, its answers ~10x slower: docs/design.md §5.7.)
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np

from kvroute.bench.chat_text import chat_text
from kvroute.replica.emulated.server import EmulatedReplica, ReplicaConfig
from tests.router_support import MODEL, running_router, started

SESSIONS, TURNS, IN_FLIGHT = 24, 8, 6


async def test_sessions_leave_a_replica_that_serves_them_ten_times_slower():
    replicas = [EmulatedReplica(ReplicaConfig(model=MODEL, time_scale=scale)) for scale in (10.0, 1.0, 1.0)]
    async with started(*replicas) as reps, running_router([r.url for r in reps]) as app:
        slow = reps[0].url
        served: list[str] = []
        report = app.accounting.report

        def record(route, outcome):  # which replica answered each request, in answer order
            served.append(outcome.replica)
            return report(route, outcome)

        app.accounting.report = record
        ttfts: list[float] = []
        todo = list(range(SESSIONS))
        system = chat_text((1, 0), 1_200)

        async def chat(http: aiohttp.ClientSession, session: int) -> None:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": chat_text((1, session), 2_400)}]
            for turn in range(TURNS):
                body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": True}
                sent = time.perf_counter()
                async with http.post(app.url + "/v1/chat/completions", json=body,
                                     headers={"X-Session-ID": f"s{session}"}) as resp:
                    assert resp.status == 200
                    first = None
                    async for line in resp.content:
                        if first is None and line.startswith(b"data: "):
                            first = time.perf_counter() - sent
                ttfts.append(first)
                messages += [{"role": "assistant", "content": chat_text((2, session, turn), 200)},
                             {"role": "user", "content": chat_text((3, session, turn), 150)}]

        async def worker(http: aiohttp.ClientSession) -> None:
            while todo:
                await chat(http, todo.pop(0))

        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(worker(http) for _ in range(IN_FLIGHT)))
        await asyncio.sleep(0.05)  # the last reports
        assert len(served) == SESSIONS * TURNS
        last = served[-96:]
        p99 = float(np.percentile(np.array(ttfts[-96:]) * 1e3, 99))
        print(f"slow replica served {served[:96].count(slow)} of the first 96 requests, {last.count(slow)} of the "
              f"last 96; TTFT p99 of the last 96: {p99:.0f} ms")
        assert last.count(slow) <= 3
