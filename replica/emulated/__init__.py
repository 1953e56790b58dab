"""Emulated vLLM replica: a modelled prefix cache, scheduler and step timing in virtual time."""

from kvroute.replica.emulated.block_pool import BlockPool
from kvroute.replica.emulated.engine import EmulatedEngine, EngineRequest, EngineUpdate
from kvroute.replica.emulated.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvroute.replica.emulated.profile import CPU_TINY, DEFAULT_PROFILE, LLAMA3_8B_H100, PROFILES, TimingProfile

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
