"""Prefix index: which replica holds which block (memory or Redis backend, one client for both)."""

from .base import PrefixIndex, ReplicaSpec
from .client import IndexClient
from .memory import MemoryIndex
from .redis_index import RedisIndex

__all__ = ["PrefixIndex", "ReplicaSpec", "IndexClient", "MemoryIndex", "RedisIndex"]
