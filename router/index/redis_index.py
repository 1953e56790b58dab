"""Redis prefix index, shared by several routers: same semantics as ``MemoryIndex`` (docs/design.md §3).

Keys (docs/design.md §3.5): under ``P`` = ``<key_prefix>:{<scheme>}`` (or ``{<scheme>/<shard>}``),
per replica ``l`` (every entry, the LRU order) and exactly one of ``c`` (confirmed), ``p``
(predictions that never expire) and ``x`` (predictions that expire; ``t`` mirrors its members);
shared ``cap``, ``ev``, ``seq`` and ``epoch``.  A block hash is its 8 bytes little-endian, so a chain
travels as one binary string.  Every key lives ``key_ttl_s`` past the last write or ``refresh``
naming it, and the epoch tells a router that Redis lost its state (§3.6).

Per-replica keys rather than one hash per block: a lookup asks each replica about a whole slice
of the chain in one command (galloping 32, 128, 512, 1024 blocks) and stops at its first miss,
and a write of a 512-block chain is a handful of commands instead of one per block.  Lookups ask
sets (SMISMEMBER answers integers); ZMSCORE formats a double per member, about three times the
cost, so it is read only while an expired prediction still awaits its purge.  No state sits in a
hash: Redis keeps hashes of up to 512 fields as listpacks, where each field lookup is a scan.

Every operation is one Lua script (EVALSHA), so one round trip, timed by Redis's TIME; the scripts
are lua/*.lua beside this module (package data, joined into each script's text at import).  Each
write script first purges the replica's expired predictions; predictions and confirmed entries are
bounded apart, victims found in ``l`` a page at a time (§3.3).

All keys of one index share one hash tag, so every script runs on one Redis Cluster shard.  The
scripts declare the registry key and derive the others from it: that works on Redis Cluster and
Valkey because all keys hash to the same slot, but a proxy that insists on declared keys only would
reject it.  One shard's memory and CPU bound the index (``python -m kvroute.bench.index_bench``;
sizing: docs/experiments.md); beyond that, one index per model (``shard=model``).  Needs Redis >=
6.2 (or Valkey).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError

from kvroute.common.blocks import HASH_SCHEME

from kvroute.router.index.base import PrefixIndex, ReplicaSpec

# Keys outlive the last write or refresh by this much: a live router refreshes them every second
# or so, so it only matters once every router sharing the index has gone (or forgot a replica).
DEFAULT_KEY_TTL_S = 600.0
DEFAULT_TIMEOUT_S = 1.0  # connect and per-reply timeout of a client made from a URL


def _lua(*parts: str) -> str:
    """A script's text: its parts (lua/PART.lua beside this module, package data) in order."""
    folder = resources.files(__package__) / "lua"
    return "".join("\n" + (folder / f"{part}.lua").read_text(encoding="utf-8") for part in parts)


# prelude.lua starts every script; replica_prelude.lua follows it in the scripts on one replica's entries.
_LOOKUP = _lua("prelude", "lookup")
_ADD_REPLICA = _lua("prelude", "replica_prelude", "add_replica")
_REMOVE_REPLICA = _lua("prelude", "replica_prelude", "remove_replica")
_RECORD_PREDICTION = _lua("prelude", "replica_prelude", "record_prediction")
_CONFIRM = _lua("prelude", "replica_prelude", "confirm")
_REMOVE = _lua("prelude", "replica_prelude", "remove")
_CLEAR_REPLICA = _lua("prelude", "replica_prelude", "clear_replica")
_DROP_CONFIRMED = _lua("prelude", "replica_prelude", "drop_confirmed")
_ENTRY_COUNT = _lua("prelude", "replica_prelude", "entry_count")
_REFRESH = _lua("prelude", "refresh")


def pack_chain(hashes: Sequence[int]) -> bytes:
    """Unsigned 64-bit hashes as one string of 8-byte little-endian members."""
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisIndex(PrefixIndex):
    """The prefix index in Redis: every call is one EVALSHA round trip.

    ``url_or_client``: a Redis URL (the index owns and closes that client, with ``timeout_s`` to
    connect and per reply, and one retry on a lost connection, none on a timeout) or a
    ``redis.asyncio`` client (left open).  Indexes with the same ``key_prefix`` and ``shard``
    share everything.  Every key written lives ``key_ttl_s`` past the last write or ``refresh``
    naming it, so a fleet of routers that has gone leaves nothing behind for good.
    """

    def __init__(
        self,
        url_or_client: str | aioredis.Redis,
        *,
        key_prefix: str = "kvroute",
        predicted_ttl_s: float = 30.0,
        shard: str = "",
        key_ttl_s: float = DEFAULT_KEY_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        if any(c in key_prefix + shard for c in "{}"):
            raise ValueError("key_prefix and shard must not contain '{' or '}' (the hash tag is ours)")
        if isinstance(url_or_client, str):
            # one retry, on a lost connection only: a pooled connection to a Redis that restarted
            # fails once, and every script is safe to run twice; a timeout is the caller's verdict
            retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
            self.client = aioredis.Redis.from_url(
                url_or_client, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry
            )
            self._owns_client = True
        else:
            self.client = url_or_client
            self._owns_client = False
        self.predicted_ttl_s = predicted_ttl_s
        self._keep_ms = round(key_ttl_s * 1000)
        tag = HASH_SCHEME if not shard else f"{HASH_SCHEME}/{shard}"
        self.base = f"{key_prefix}:{{{tag}}}"
        # Declared key of every script: it carries the hash tag, so Cluster routes by it.
        self._registry_key = f"{self.base}:cap"
        register = self.client.register_script
        self._lookup = register(_LOOKUP)
        self._add_replica = register(_ADD_REPLICA)
        self._remove_replica = register(_REMOVE_REPLICA)
        self._record_prediction = register(_RECORD_PREDICTION)
        self._confirm = register(_CONFIRM)
        self._remove = register(_REMOVE)
        self._clear_replica = register(_CLEAR_REPLICA)
        self._drop_confirmed = register(_DROP_CONFIRMED)
        self._entry_count = register(_ENTRY_COUNT)
        self._refresh = register(_REFRESH)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisIndex:
        return cls(url, **kwargs)

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    async def _run(self, script: AsyncScript, *args: str | int | bytes) -> Any:
        return await script(keys=[self._registry_key], args=[self.base, self._keep_ms, *args])

    # -- replicas -------------------------------------------------------------------------
    async def add_replica(self, spec: ReplicaSpec) -> None:
        await self._run(self._add_replica, spec.name, spec.capacity_blocks, int(spec.publishes_events))

    async def remove_replica(self, name: str) -> None:
        await self._run(self._remove_replica, name)

    async def replicas(self) -> dict[str, ReplicaSpec]:
        """The shared registry: every replica any router sharing this index has added."""
        async with self.client.pipeline(transaction=True) as pipe:
            caps, events = await pipe.hgetall(self._registry_key).hgetall(f"{self.base}:ev").execute()
        return {
            _text(name): ReplicaSpec(_text(name), int(cap), events.get(name) in (b"1", "1"))
            for name, cap in caps.items()
        }

    async def clear_replica(self, name: str) -> None:
        await self._run(self._clear_replica, name)

    async def drop_confirmed(self, name: str) -> None:
        await self._run(self._drop_confirmed, name)

    async def entry_count(self, name: str) -> int:
        return int(await self._run(self._entry_count, name))

    async def refresh(self, replicas: Sequence[str], token: str) -> str:
        return _text(await self._run(self._refresh, token, *replicas))

    # -- lookups --------------------------------------------------------------------------
    async def lookup(self, chain: Sequence[int]) -> dict[str, int]:
        if not chain:
            return {}
        flat = await self._run(self._lookup, pack_chain(chain))
        return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    # -- writes ---------------------------------------------------------------------------
    async def record_prediction(self, replica: str, chain: Sequence[int]) -> bool:
        if not chain:
            return True
        ttl_ms = round(self.predicted_ttl_s * 1000)
        return bool(await self._run(self._record_prediction, replica, pack_chain(chain), ttl_ms))

    async def confirm(self, replica: str, hashes: Sequence[int]) -> bool:
        if not hashes:
            return True
        return bool(await self._run(self._confirm, replica, pack_chain(hashes)))

    async def remove(self, replica: str, hashes: Sequence[int]) -> None:
        if hashes:
            await self._run(self._remove, replica, pack_chain(hashes))
