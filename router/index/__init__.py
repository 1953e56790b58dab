"""Prefix index: which replica holds which block (memory or Redis backend, one client for both)."""

from kvroute.router.index.base import PrefixIndex, ReplicaSpec
from kvroute.router.index.client import IndexClient
from kvroute.router.index.memory import MemoryIndex
from kvroute.router.index.redis_index import RedisIndex

__all__ = ["PrefixIndex", "ReplicaSpec", "IndexClient", "MemoryIndex", "RedisIndex"]
