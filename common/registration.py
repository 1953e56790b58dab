"""Replica registration in Redis, written by replica launchers and read by routers.

Each replica owns a hash ``<prefix>:replicas:<name>`` whose TTL its heartbeats refresh: a replica
that stops heartbeating (crashed, partitioned) disappears by itself once the TTL lapses.  A set
``<prefix>:replica_names`` lists the names so routers need no SCAN over a shared keyspace; members
whose hash has lapsed are pruned when listed, and every heartbeat re-adds its own name (so a prune
racing a re-registration heals within one heartbeat).

With a shared secret (``registration_auth.py``) every heartbeat rewrites the whole hash, signed with
a fresh expiry: routers holding the secret believe only signed, unexpired entries, and an entry
someone overwrote is restored by the replica's next heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel, ValidationError, model_validator

from kvroute.common.registration_auth import sign

log = logging.getLogger(__name__)


class ReplicaRecord(BaseModel):
    url: str  # base URL of its OpenAI server, e.g. http://10.0.0.5:8000
    name: str = ""  # registration id; defaults to the URL
    model: str | None = None
    events_endpoint: str | None = None  # ZMQ PUB endpoint of its KV events, as a subscriber dials it
    replay_endpoint: str | None = None
    block_size: int | None = None
    capacity_blocks: int | None = None
    engine: str = "vllm"  # "vllm" | "emulated"

    @model_validator(mode="after")
    def _default_name(self) -> ReplicaRecord:
        self.url = self.url.rstrip("/")
        if not self.name:
            self.name = self.url
        return self

    def to_hash(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.model_dump().items() if v is not None}


def record_key(prefix: str, name: str) -> str:
    return f"{prefix}:replicas:{name}"


def names_key(prefix: str) -> str:
    return f"{prefix}:replica_names"


def _ttl_ms(ttl: float) -> int:
    return max(1, int(ttl * 1000))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def register(
    redis: aioredis.Redis, prefix: str, record: ReplicaRecord, ttl: float, secret: bytes | None = None
) -> None:
    """Write (or overwrite) the record with a fresh TTL; signed, expiring with it, given a ``secret``."""
    key = record_key(prefix, record.name)
    fields = record.to_hash()
    if secret is not None:
        fields = sign(fields, prefix, record.name, secret, time.time() + ttl)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(key)  # fields set to None since the last registration must not linger
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, _ttl_ms(ttl))
        pipe.sadd(names_key(prefix), record.name)
        await pipe.execute()


async def heartbeat(
    redis: aioredis.Redis, prefix: str, record: ReplicaRecord, ttl: float, secret: bytes | None = None
) -> bool:
    """Refresh the TTL.  Returns False if the registration had lapsed (it is then rewritten).
    Signed (a ``secret``): the whole hash is rewritten with a new expiry, which also undoes an
    overwrite by someone else; True."""
    if secret is not None:
        await register(redis, prefix, record, ttl, secret)
        return True
    async with redis.pipeline(transaction=True) as pipe:
        pipe.pexpire(record_key(prefix, record.name), _ttl_ms(ttl))
        pipe.sadd(names_key(prefix), record.name)
        refreshed, _ = await pipe.execute()
    if not refreshed:
        await register(redis, prefix, record, ttl)
        return False
    return True


async def deregister(redis: aioredis.Redis, prefix: str, name: str) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(record_key(prefix, name))
        pipe.srem(names_key(prefix), name)
        await pipe.execute()


async def list_registrations(redis: aioredis.Redis, prefix: str) -> list[tuple[str, dict[str, str]]]:
    """Live registration hashes (TTL not lapsed) as stored, with their names, sorted by name.
    Two round trips; names whose hash has lapsed are pruned from the set."""
    names = sorted(_text(n) for n in await redis.smembers(names_key(prefix)))
    if not names:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(record_key(prefix, name))
        hashes = await pipe.execute()
    listed = [(name, {_text(k): _text(v) for k, v in raw.items()}) for name, raw in zip(names, hashes, strict=True)]
    lapsed = [name for name, fields in listed if not fields]
    if lapsed:
        await redis.srem(names_key(prefix), *lapsed)
    return [(name, fields) for name, fields in listed if fields]


def parse_record(name: str, fields: dict[str, str]) -> ReplicaRecord | None:
    """The record of a registration hash; None (logged) if it is malformed."""
    try:
        return ReplicaRecord(**fields)
    except ValidationError as exc:
        log.warning("ignoring malformed registration %r: %s", name, exc)
        return None


async def list_replicas(redis: aioredis.Redis, prefix: str) -> list[ReplicaRecord]:
    """Live registrations (TTL not lapsed), sorted by name, none verified (see registration_auth)."""
    records = (parse_record(name, fields) for name, fields in await list_registrations(redis, prefix))
    return [r for r in records if r is not None]


async def keep_registered(
    redis: aioredis.Redis,
    prefix: str,
    record: ReplicaRecord,
    ttl: float,
    interval: float | None = None,
    *,
    registered: bool = False,
    secret: bytes | None = None,
) -> None:
    """Register (unless ``registered`` says it was just done), then heartbeat every ``interval``
    (default ttl/3) until cancelled.

    Redis being unreachable is logged and retried: the registration lapses meanwhile, and is
    rewritten by the first heartbeat that gets through.  Cancelling does not deregister (the caller
    decides: a clean shutdown should, a crash cannot).
    """
    interval = ttl / 3 if interval is None else interval
    while True:
        if registered:
            await asyncio.sleep(interval)
        try:
            if registered:
                await heartbeat(redis, prefix, record, ttl, secret)
            else:
                await register(redis, prefix, record, ttl, secret)
                registered = True
        except (aioredis.RedisError, OSError) as exc:
            log.warning("registration of %s in Redis failed: %s", record.name, exc)
            if not registered:
                await asyncio.sleep(interval)


class KeptRegistration:
    """A launcher's registration of its replica: written once by ``start`` (so it exists when the
    launcher says it is ready), then kept alive by heartbeats.  ``deregister`` ends it (routers stop
    sending: a clean shutdown); ``close`` only stops the heartbeats (a crash: it lapses by its TTL).
    With a ``secret`` every write is signed (routers holding it believe nothing else)."""

    def __init__(self, redis_url: str, prefix: str, record: ReplicaRecord, ttl: float, secret: bytes | None = None):
        self.prefix, self.record, self.ttl = prefix, record, ttl
        self._secret = secret
        self._redis = aioredis.Redis.from_url(redis_url)
        self._heartbeat: asyncio.Task[None] | None = None

    async def start(self) -> None:
        registered = True
        try:
            await register(self._redis, self.prefix, self.record, self.ttl, self._secret)
        except (aioredis.RedisError, OSError) as exc:
            registered = False
            log.warning("registration in Redis failed, retrying with the heartbeats: %s", exc)
        self._heartbeat = asyncio.create_task(
            keep_registered(
                self._redis, self.prefix, self.record, self.ttl, registered=registered, secret=self._secret
            )
        )

    async def deregister(self) -> None:
        if self._heartbeat is None:
            return  # never started, or deregistered already
        await self._stop_heartbeats()  # first: a heartbeat after the deregistration would undo it
        try:
            await deregister(self._redis, self.prefix, self.record.name)
        except (aioredis.RedisError, OSError) as exc:  # the TTL removes it anyway
            log.warning("deregistration failed (the registration lapses by its TTL): %s", exc)

    async def close(self) -> None:
        await self._stop_heartbeats()
        await self._redis.aclose()

    async def _stop_heartbeats(self) -> None:
        task, self._heartbeat = self._heartbeat, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
