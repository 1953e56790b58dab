"""Prefix index: which replica holds which block (memory or Redis backend)."""

from .base import PrefixIndex, ReplicaSpec
from .memory import MemoryIndex
from .redis_index import RedisIndex

__all__ = ["PrefixIndex", "ReplicaSpec", "MemoryIndex", "RedisIndex"]
