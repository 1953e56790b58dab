"""Prefix index: which replica holds which block (memory or Redis backend)."""

from .base import PrefixIndex, ReplicaSpec
from .memory import MemoryIndex

__all__ = ["PrefixIndex", "ReplicaSpec", "MemoryIndex"]
