"""Issue 21's two Redis attacks against an in-process router, without and with a registration secret
(docs/experiments.md, 2026-12-04): `.venv/bin/python -m tests.registration_attack` from the
repository root, with a Redis at 127.0.0.1:6379 (keys under a prefix of its own, left to expire
or be deleted).  Not a test: it prints what the rogue got; tests/test_registration_auth.py asserts."""

from __future__ import annotations

import asyncio
import time
import uuid

import openai
import redis.asyncio as aioredis

from kvroute.common.registration import KeptRegistration, ReplicaRecord, names_key, record_key
from tests.router_support import MODEL, emulated_replicas, running_router
from tests.test_registration_auth import Rogue

REDIS = "redis://127.0.0.1:6379/0"
KEY = "the-fleet-replica-key"

async def chats(app, n: int) -> list[str]:
    """``n`` chats through the router: each answer's text (the rogue's is "fabricated")."""
    c = openai.AsyncOpenAI(base_url=app.url + "/v1", api_key="x", max_retries=0)
    out = []
    for i in range(n):
        try:
            r = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"chat {i} {uuid.uuid4()}"}], max_tokens=4)
            out.append(r.choices[0].message.content)
        except openai.APIError as e:
            out.append(f"error {type(e).__name__}")
    await c.close()
    return out

async def scenario(secret: bytes | None) -> None:
    """Two signed-or-not replicas registered; a new rogue entry for 40 chats; then the first
    replica's entry pointed at the rogue, 40 chats, 30 s, 20 chats."""
    prefix = f"kvroute-attack-{uuid.uuid4().hex[:8]}"
    r = aioredis.Redis.from_url(REDIS, decode_responses=True)
    async with emulated_replicas(2, api_key=KEY) as reps, Rogue() as rogue:
        regs = [KeptRegistration(REDIS, prefix, ReplicaRecord(url=rep.url, model=MODEL, engine="emulated"), 15.0, secret=secret) for rep in reps]
        for g in regs: await g.start()
        extra = {"registration_secret": secret.decode()} if secret else {}
        async with running_router([], fleet={"discovery_redis": True, "redis_url": REDIS, "redis_key_prefix": prefix,
                "replica_api_key": KEY, "health_interval_s": 2.0, "events_port": 0, "replay_port": 0}, kv_events=False, **extra) as app:
            while sum(1 for x in app.fleet.replicas() if x.healthy) < 2: await asyncio.sleep(0.1)
            t0 = time.monotonic()
            await r.hset(record_key(prefix, "evil"), mapping={"url": rogue.url, "model": MODEL}); await r.sadd(names_key(prefix), "evil")
            joined: float | None = None
            while time.monotonic() - t0 < 6:
                x = app.fleet.get(rogue.url)
                if x is not None and x.healthy: joined = time.monotonic() - t0; break
                await asyncio.sleep(0.05)
            a1 = await chats(app, 40)
            keys1 = sum(1 for p, a in rogue.seen if a == f"Bearer {KEY}")
            await r.delete(record_key(prefix, "evil")); await r.srem(names_key(prefix), "evil")
            await asyncio.sleep(4.5)
            await r.hset(record_key(prefix, reps[0].url), "url", rogue.url)
            await asyncio.sleep(4.5)
            a2 = await chats(app, 40)
            await asyncio.sleep(30)
            a3 = await chats(app, 20)
            keys = sum(1 for p, a in rogue.seen if a == f"Bearer {KEY}")
            print(f"secret={'yes' if secret else 'no '}: new entry: joined after {joined and round(joined,1)} s, "
                  f"{a1.count('fabricated')}/40 chats to the rogue, {keys1} requests with the key; "
                  f"overwrite: {a2.count('fabricated')}/40 diverted, {a3.count('fabricated')}/20 after 30 s more; "
                  f"errors {sum(x.startswith('error') for x in a1+a2+a3)}; rogue saw {len(rogue.seen)} requests, {keys} with the key")
        for g in regs: await g.deregister(); await g.close()
    await r.aclose()

async def main():
    await scenario(None)
    await scenario(b"attack-test-secret")
asyncio.run(main())
