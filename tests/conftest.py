"""Shared fixtures.  Redis is real: REDIS_URL (default redis://127.0.0.1:6379/0).

A missing Redis fails the tests that need it with a clear message; nothing is skipped silently.
Every test uses its own key prefix and deletes only its own keys: the server is shared.
"""

from __future__ import annotations

import os
import socket
import uuid

import pytest

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001 - any failure means the same thing here
        pytest.fail(f"Redis is required at REDIS_URL={REDIS_URL} and is not reachable: {exc}", pytrace=False)
    return REDIS_URL


@pytest.fixture
async def redis_prefix(redis_url):
    """A unique key prefix; all keys under it are deleted afterwards (never FLUSHDB)."""
    import redis.asyncio as aioredis

    prefix = f"kvroute-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
