"""Replicas registered in Redis by kvroute's launchers (``kvroute.common.registration``): a registration whose
TTL lapses (its replica stopped heartbeating) leaves the listing.

With the fleet's registration secrets (one, or the new and the previous during a rotation) only
registrations signed with one of them and unexpired are listed
(``kvroute.common.registration_auth``; docs/design.md §7.7): any other entry, new or overwritten,
is ignored, counted at every listing (``kvroute_discovery_rejected_total{reason}``) and logged once
per entry.  An entry that stops verifying leaves the listing, so the fleet drops its replica and
stops sending it requests and the replica API key."""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from kvroute.common.registration import ReplicaRecord, list_registrations, parse_record
from kvroute.common.registration_auth import Rejection, verify

from kvroute.router.fleet.discovery.base import DiscoverySource, Listing, normalize_url
from kvroute.router.fleet.discovery.metrics import DiscoveryMetrics

log = logging.getLogger("kvroute.router.fleet")


class RedisSource(DiscoverySource):
    name = "redis"

    def __init__(
        self,
        redis: aioredis.Redis,
        key_prefix: str,
        timeout_s: float,
        *,
        owned: bool = False,
        secrets: tuple[bytes, ...] = (),
        metrics: DiscoveryMetrics | None = None,
    ):
        self._redis = redis
        self._prefix = key_prefix
        self._timeout_s = timeout_s
        self._owned = owned  # created for this source: closed with it
        self._secrets = secrets  # none: every registration believed
        self._metrics = metrics if metrics is not None else DiscoveryMetrics()
        self._seen: dict[str, ReplicaRecord] = {}  # last successful listing
        self._rejected: dict[str, tuple[Rejection, str]] = {}  # entries ignored now: (reason, url), logged once

    @classmethod
    def from_url(
        cls, url: str, key_prefix: str, timeout_s: float, *, secrets: tuple[bytes, ...] = (),
        metrics: DiscoveryMetrics | None = None,
    ) -> RedisSource:
        client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, key_prefix, timeout_s, owned=True, secrets=secrets, metrics=metrics)

    async def list(self) -> Listing:
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that
            # lands as the answer arrives, and the fleet's stop() would wait for its loop forever
            async with asyncio.timeout(self._timeout_s):
                listed = await list_registrations(self._redis, self._prefix)
            records = [r for r in (self._believed(name, fields) for name, fields in listed) if r is not None]
            self._forget_rejections({name for name, _ in listed})
            self._seen = {normalize_url(rec.url): rec for rec in records}
        except (aioredis.RedisError, OSError, TimeoutError) as exc:
            log.warning("Redis discovery failed, keeping %d known registrations: %s", len(self._seen), exc)
        return dict(self._seen)

    def _believed(self, name: str, fields: dict[str, str]) -> ReplicaRecord | None:
        """The entry's record if it may be believed (no secret configured, or its signature holds
        with one of them)."""
        if self._secrets:
            reason = verify(fields, self._prefix, name, self._secrets, time.time())
            if reason is not None:
                self._reject(name, reason, fields.get("url", ""))
                return None
        self._rejected.pop(name, None)
        return parse_record(name, fields)

    def _reject(self, name: str, reason: Rejection, url: str) -> None:
        self._metrics.rejected.labels(reason).inc()
        if self._rejected.get(name) != (reason, url):
            self._rejected[name] = (reason, url)
            log.warning(
                "ignoring the Redis registration %r (url %r): %s; its replica gets no requests and no API key "
                "(registrations must be signed with the fleet's registration secret: docs/deploy.md)",
                name, url, _EXPLAINED[reason],
            )

    def _forget_rejections(self, listed: set[str]) -> None:
        for name in [n for n in self._rejected if n not in listed]:
            del self._rejected[name]

    async def close(self) -> None:
        if self._owned:
            await self._redis.aclose()


_EXPLAINED: dict[Rejection, str] = {
    "unsigned": "unsigned",
    "bad_signature": "its signature does not match (altered, or signed with another secret)",
    "stale": "its signature expired (a replayed old registration, or clocks apart)",
}
