"""Fair share measured (issue 20 item 3): a light tenant at R req/s, a heavy one at 10 R, against a
router whose capacity (slots / the replica's service time) the heavy tenant alone exceeds; the light
tenant's p50/p99 alone and beside the heavy one, and what each shed.  Router, replica and clients run
in this one process, as in tests/test_router_overload.py, so at high rates the tail includes their
shared CPU; ``--apart`` runs the router in a process of its own on core 0 and the rest on core 1.
``python -m tests.fairness_measure [--apart] SLOTS,SERVICE_S,LIGHT_RATE ...`` (e.g. 16,1.0,2).
"""
import asyncio
import os
import statistics
import sys

import openai

from tests.test_router_overload import PacedReplica, open_loop, p99
from tests.router_support import RouterProcess, openai_client, running_router

APART = "--apart" in sys.argv  # the router in a process of its own, pinned apart from the clients


async def one(slots: int, delay: float, light_rate: float, duration: float) -> dict:
    async with PacedReplica(delay_s=delay) as rep:
        if APART:  # the router in its own process on core 0, this one (clients, replica) on core 1
            router = await RouterProcess.start([rep.url], "--max-in-flight", str(slots), "--max-queue-wait-s", "2.0",
                                               "--no-access-log", prefix=["taskset", "-c", "0"])
            os.sched_setaffinity(0, {1})
            clients = [openai.AsyncOpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)
                       for key in ("light-key", "heavy-key")]
            try:
                return await measure(*clients, light_rate, duration, slots, delay)
            finally:
                for client in clients:
                    await client.close()
                await router.stop()
        async with running_router([rep.url], max_in_flight=slots, max_queue_wait_s=2.0) as app:
            light, heavy = openai_client(app, api_key="light-key"), openai_client(app, api_key="heavy-key")
            return await measure(light, heavy, light_rate, duration, slots, delay)


async def measure(light, heavy, light_rate: float, duration: float, slots: int, delay: float) -> dict:
    alone = await asyncio.gather(*open_loop(light, light_rate, duration))
    lt = open_loop(light, light_rate, duration)
    ht = open_loop(heavy, 10 * light_rate, duration)
    lr = await asyncio.gather(*lt)
    hr = await asyncio.gather(*ht)
    a = [r["elapsed"] for r in alone if r["status"] == 200]
    l = [r["elapsed"] for r in lr if r["status"] == 200]
    h = [r["elapsed"] for r in hr if r["status"] == 200]
    return {"slots": slots, "delay": delay, "capacity": slots / delay, "light": light_rate, "heavy": 10 * light_rate,
            "alone_p50": statistics.median(a), "alone_p99": p99(a), "light_p50": statistics.median(l), "light_p99": p99(l),
            "light_shed": sum(r["status"] == 429 for r in lr), "heavy_p50": statistics.median(h), "heavy_p99": p99(h),
            "heavy_shed": sum(r["status"] == 429 for r in hr), "heavy_sent": len(hr)}


async def main():
    for slots, delay, rate in [tuple(map(float, a.split(","))) for a in [a for a in sys.argv[1:] if a != "--apart"] or ["16,1.0,2"]]:
        slots = int(slots)
        r = await one(slots, delay, rate, 8.0)
        print(f"slots {slots:3d} service {delay*1000:.0f} ms capacity {r['capacity']:.0f}/s; light {rate}/s heavy {10*rate}/s: "
              f"light alone p50/p99 {r['alone_p50']*1000:.0f}/{r['alone_p99']*1000:.0f} ms, loaded {r['light_p50']*1000:.0f}/"
              f"{r['light_p99']*1000:.0f} ms (p99 x{r['light_p99']/r['alone_p99']:.2f}), light shed {r['light_shed']}; "
              f"heavy p50/p99 {r['heavy_p50']*1000:.0f}/{r['heavy_p99']*1000:.0f} ms, shed {r['heavy_shed']}/{r['heavy_sent']}", flush=True)

if __name__ == "__main__":
    asyncio.run(main())
