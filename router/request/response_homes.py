"""Where each stored Responses API response lives: response id -> the replica that stored it.

vLLM keeps a stored response in the memory of the replica that produced it, so a request that
names it (``previous_response_id``, ``GET /v1/responses/{id}``, ``/cancel``) must reach that
replica: any other answers 404.  This process's :class:`ResponseMemory` knows the ids it relayed;
with a Redis configured (``--redis-url``) every id is also written there, ``<prefix>:resp:<id>`` ->
replica name, living ``responses_ttl_s``, so every router and every worker behind one port finds
the replica of an id another one relayed.  The write is awaited before the client has the
response (so its next request finds it, wherever it lands), within ``timeout_s``; a Redis that
fails or is slow costs only the cross-router lookup (logged), never the request.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvroute.router.request.response_memory import ResponseMemory

log = logging.getLogger("kvroute.router")

_REDIS_FAILURES = (RedisError, OSError, TimeoutError)


class ResponseHomes:
    """Response id -> replica name: this process's memory first, then the shared Redis (if any)."""

    def __init__(self, memory: ResponseMemory, redis_url: str | None, *, key_prefix: str, ttl_s: float,
                 timeout_s: float):
        self.memory = memory
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.timeout_s = timeout_s
        self._prefix = f"{key_prefix}:resp:"
        self._redis: aioredis.Redis | None = None
        if redis_url:
            self._redis = aioredis.Redis.from_url(
                redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
            )

    @property
    def shared(self) -> bool:
        return self._redis is not None

    async def record(self, response_id: str, replica: str) -> None:
        """``replica`` stored ``response_id`` (this process's memory has it already)."""
        if self._redis is None:
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._redis.set(self._prefix + response_id, replica, px=self.ttl_ms)
        except _REDIS_FAILURES as exc:
            log.warning("response %r: its replica not written to Redis (other routers cannot find it): %r",
                        response_id, exc)

    async def find(self, response_id: str) -> str | None:
        """The replica that stored ``response_id``, or None if neither this process nor Redis knows it."""
        known = self.memory.replica_of(response_id)
        if known is not None or self._redis is None:
            return known
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._redis.get(self._prefix + response_id)
        except _REDIS_FAILURES as exc:
            log.warning("response %r: its replica not read from Redis: %r", response_id, exc)
            return None

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
