"""Emulated vLLM replica: a modelled prefix cache, scheduler and step timing in virtual time."""

from .block_pool import BlockPool
from .engine import EmulatedEngine, EngineRequest, EngineUpdate
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from .profile import CPU_TINY, DEFAULT_PROFILE, LLAMA3_8B_H100, PROFILES, TimingProfile

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CPU_TINY",
    "DEFAULT_PROFILE",
    "EmulatedEngine",
    "EngineRequest",
    "EngineUpdate",
    "KVEvent",
    "LLAMA3_8B_H100",
    "PROFILES",
    "TimingProfile",
]
