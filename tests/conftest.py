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


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on now, and never one this process handed out before:
    ports are picked before their servers bind them (several replicas' ports at once), and the
    OS may give a port just released to the next pick (two vLLM replicas got one replay port)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def require_redis() -> str:
    """REDIS_URL, or a failed test saying Redis is missing (never a silent skip)."""
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except Exception as exc:  # noqa: BLE001 - any failure means the same thing here
        pytest.fail(f"Redis is required at REDIS_URL={REDIS_URL} and is not reachable: {exc}", pytrace=False)
    return REDIS_URL


def delete_keys(prefix: str) -> None:
    """Delete the keys under one test prefix (the server is shared: never FLUSHDB)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def redis_url() -> str:
    return require_redis()


@pytest.fixture
def redis_prefix(redis_url):
    """A unique key prefix; all keys under it are deleted afterwards."""
    prefix = f"kvroute-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    delete_keys(prefix)
