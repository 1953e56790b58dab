"""Replicas registered in Redis by kvroute's launchers (``kvroute.common.registration``): a registration whose
TTL lapses (its replica stopped heartbeating) leaves the listing."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from kvroute.common.registration import ReplicaRecord, list_replicas

from kvroute.router.fleet.discovery.base import DiscoverySource, Listing, normalize_url

log = logging.getLogger("kvroute.router.fleet")


class RedisSource(DiscoverySource):
    name = "redis"

    def __init__(self, redis: aioredis.Redis, key_prefix: str, timeout_s: float, *, owned: bool = False):
        self._redis = redis
        self._prefix = key_prefix
        self._timeout_s = timeout_s
        self._owned = owned  # created for this source: closed with it
        self._seen: dict[str, ReplicaRecord] = {}  # last successful listing

    @classmethod
    def from_url(cls, url: str, key_prefix: str, timeout_s: float) -> RedisSource:
        client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, key_prefix, timeout_s, owned=True)

    async def list(self) -> Listing:
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that
            # lands as the answer arrives, and the fleet's stop() would wait for its loop forever
            async with asyncio.timeout(self._timeout_s):
                records = await list_replicas(self._redis, self._prefix)
            self._seen = {normalize_url(rec.url): rec for rec in records}
        except (aioredis.RedisError, OSError, TimeoutError) as exc:
            log.warning("Redis discovery failed, keeping %d known registrations: %s", len(self._seen), exc)
        return dict(self._seen)

    async def close(self) -> None:
        if self._owned:
            await self._redis.aclose()
