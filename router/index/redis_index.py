"""Redis prefix index, shared by several routers: same semantics as ``MemoryIndex``.

Layout.  ``P`` is ``<key_prefix>:{<scheme>}`` (or ``{<scheme>/<shard>}``); a block hash is its
8 bytes little-endian, so a chain travels as one binary string and a member costs 8 bytes.

    P:cap         HASH  replica -> capacity in blocks      (the registry, shared by all routers)
    P:ev          HASH  replica -> 1 if it publishes KV events, else 0
    P:seq         counter giving LRU touch stamps
    P:l:<name>    ZSET  hash -> touch stamp: every entry of the replica, the LRU order
    P:c:<name>    SET   confirmed entries
    P:p:<name>    SET   predictions that never expire (the replica publishes no events)
    P:x:<name>    ZSET  hash -> expiry in ms (Redis TIME): predictions that expire
    P:t:<name>    SET   the same members as ``x``
    P:epoch       STRING a token the first router to find none sets (see ``refresh``)

An entry is in ``l`` and in exactly one of ``c``, ``p``, ``x`` (``t`` mirrors ``x``).

Lifetime.  Every key lives ``key_ttl_s`` (default 10 minutes) past the last write or ``refresh``
naming it; a live router refreshes the keys of the replicas it knows about every second or so
(router/index/client.py), so only a fleet of routers that has gone, or a replica no router knows
any more, lets keys expire.  A Redis restarted empty or flushed has no epoch: the next refresh
sets a new one, and each router, seeing an epoch other than the one it knew, re-registers its
replicas (the KV-event streams replay what the replicas still buffer).

Per-replica keys rather than one hash per block: a lookup asks each replica about a whole slice
of the chain in one command (galloping 32, 128, 512, 1024 blocks) and stops at its first miss,
and a write of a 512-block chain is a handful of commands instead of one per block.  Lookups ask
sets (SMISMEMBER answers integers); ZMSCORE formats a double per member, about three times the
cost, so it is read only while an expired prediction still awaits its purge.  No state sits in a
hash: Redis keeps hashes of up to 512 fields as listpacks, where each field lookup is a scan.

Every operation is one Lua script (EVALSHA), so one round trip; the clock is Redis's TIME, so
routers need no synchronised clocks.  Expired predictions are purged at the start of every write
script on that replica, so they never take capacity from live entries.  Predictions and confirmed
entries are bounded apart (each at the capacity, least recently touched first, found in ``l``
a page at a time), so a prediction never evicts a confirmed entry.

Cluster.  All keys of one index share one hash tag, the scheme (plus an optional ``shard`` name),
so every script runs on one shard.  The scripts declare the registry key and derive the others
from it; that works on Redis Cluster and Valkey because all keys hash to the same slot, but a
proxy that insists on declared keys only would reject it.  The limit is one shard's memory:
``bench/index_bench.py`` measures about 160 bytes per confirmed or never-expiring entry and 260
per expiring prediction (Redis 7.0; predictions are short-lived on replicas with events), so a
25 GB shard holds some 150 M entries, e.g. 64 replicas of 2.4 M blocks each (38 M tokens each
at 16 tokens a block, far above one GPU's KV cache).  CPU bounds it too: the same bench times a
512-block write that also evicts 512 entries, a renewal and a 512-block lookup over 8 holders
(the README quotes them), which bound the requests/s one shard serves.  Beyond that, run one index
per model (``shard=model``), which puts each model on its own slot; a chain never spans models
since the namespace seeds it.  Needs Redis >= 6.2 (or Valkey).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError

from router.blocks import HASH_SCHEME

from .base import PrefixIndex, ReplicaSpec

# Keys outlive the last write or refresh by this much: a live router refreshes them every second
# or so, so it only matters once every router sharing the index has gone (or forgot a replica).
DEFAULT_KEY_TTL_S = 600.0
DEFAULT_TIMEOUT_S = 1.0  # connect and per-reply timeout of a client made from a URL

# Every script's arguments start with P (the base), the TTL of the keys it writes in ms, then its own.
_COMMON = r"""
local P, KEEP = ARGV[1], tonumber(ARGV[2])
local CHUNK = 1024  -- members per command: unpack() must stay far below Lua's 8000-slot stack

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- the 8-byte hashes of a packed chain, from block s to block e
local function members(blob, s, e)
  local out = {}
  for i = s, e do out[#out + 1] = string.sub(blob, (i - 1) * 8 + 1, i * 8) end
  return out
end

-- a replica's keys: LRU, confirmed, pinned predictions, expiring predictions (ZSET and SET)
local function replica_keys(name)
  return P .. ':l:' .. name, P .. ':c:' .. name, P .. ':p:' .. name, P .. ':x:' .. name, P .. ':t:' .. name
end

-- the keys live KEEP ms from now (PEXPIRE ignores absent keys): nobody refreshing them, they go
local function keep(keys)
  for _, key in ipairs(keys) do redis.call('PEXPIRE', key, KEEP) end
end
"""

# Shared by the scripts on one replica's entries.  ARGV[3] is the replica's name.
_PRELUDE = _COMMON + r"""
local NAME = ARGV[3]
local L, C, PIN, X, T = replica_keys(NAME)

-- every key this replica's entries use, the registry and the LRU counter, renewed by each write
local function keep_all()
  keep({L, C, PIN, X, T, KEYS[1], P .. ':ev', P .. ':seq'})
end

-- cmd key item... in slices; skipped when the key does not exist
local function in_chunks(cmd, key, items)
  if #items == 0 or redis.call('EXISTS', key) == 0 then return end
  for s = 1, #items, CHUNK do
    redis.call(cmd, key, unpack(items, s, math.min(s + CHUNK - 1, #items)))
  end
end

-- take entries out of the state sets (not out of the LRU)
local function unstate(items)
  in_chunks('SREM', C, items)
  in_chunks('SREM', PIN, items)
  in_chunks('ZREM', X, items)
  in_chunks('SREM', T, items)
end

-- drop predictions whose expiry has passed, so they do not take capacity
local function purge(now)
  local gone = redis.call('ZRANGEBYSCORE', X, '-inf', now)
  if #gone > 0 then
    in_chunks('ZREM', L, gone)
    in_chunks('SREM', T, gone)
    redis.call('ZREMRANGEBYSCORE', X, '-inf', now)
  end
end

-- the `count` least recently touched entries that are (or are not) confirmed, a page at a time
local function least_recent(confirmed, count)
  local out, start, total = {}, 0, redis.call('ZCARD', L)
  while #out < count and start < total do
    local page = redis.call('ZRANGE', L, start, start + CHUNK - 1)
    local flags = redis.call('SMISMEMBER', C, unpack(page))
    for i = 1, #page do
      if (flags[i] == 1) == confirmed then
        out[#out + 1] = page[i]
        if #out == count then break end
      end
    end
    start = start + CHUNK
  end
  return out
end

-- predictions and confirmed entries are bounded apart, each at the capacity, least recently
-- touched first: a prediction never evicts what the engine said it stores
local function evict(cap)
  cap = math.max(cap, 0)
  local confirmed = redis.call('SCARD', C)
  local over = redis.call('ZCARD', L) - confirmed - cap
  if over > 0 then
    local victims
    if confirmed == 0 then
      victims = redis.call('ZRANGE', L, 0, over - 1)
      redis.call('ZREMRANGEBYRANK', L, 0, over - 1)
    else
      victims = least_recent(false, over)
      in_chunks('ZREM', L, victims)
    end
    unstate(victims)
  end
  over = confirmed - cap
  if over > 0 then
    local victims = least_recent(true, over)
    in_chunks('ZREM', L, victims)
    in_chunks('SREM', C, victims)
  end
end

-- stamp every block of the chain as just used, the head most recent: eviction then takes tails
-- first, as the engine's free queue does, not the head every longer prefix depends on.  Walked
-- backwards so that a block repeated in the chain keeps the stamp of its first occurrence.
local function touch_all(blob, n)
  local last = redis.call('INCRBY', P .. ':seq', n)
  local args = {}
  for i = n, 1, -1 do
    args[#args + 1] = last - i + 1
    args[#args + 1] = string.sub(blob, (i - 1) * 8 + 1, i * 8)
    if #args >= 2 * CHUNK then
      redis.call('ZADD', L, unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call('ZADD', L, unpack(args)) end
end
"""

_LOOKUP = _COMMON + r"""
local blob = ARGV[3]
local n = #blob / 8
if n == 0 then return {} end
local now = now_ms()
local all = members(blob, 1, n)

local function is_live(src, answer)
  return answer == 1 or (src.expiring and answer and tonumber(answer) > now)
end

-- how many of all[pos..last] are live, from pos on: ask each state set about what is unresolved
local function leading_live(sources, pos, last)
  local first = sources[1]
  local answers = redis.call(first.cmd, first.key, unpack(all, pos, last))
  local d, m = 0, #answers
  if first.expiring then
    while d < m and is_live(first, answers[d + 1]) do d = d + 1 end
  else
    while d < m and answers[d + 1] == 1 do d = d + 1 end  -- the hot loop: keep it bare
  end
  if d == m or #sources == 1 then return d end
  -- the usual case ends above.  Otherwise ask the other sets about what the first one missed,
  -- a growing window at a time: past the run's end, nothing holds the blocks, so asking about
  -- them all would be wasted
  local missed = {}
  for i = d + 1, m do
    if not is_live(first, answers[i]) then missed[#missed + 1] = i end
  end
  local at, width = 1, 8
  while at <= #missed do
    local window = {unpack(missed, at, math.min(#missed, at + width - 1))}
    for k = 2, #sources do
      if #window == 0 then break end
      local src, ask = sources[k], {}
      for i, o in ipairs(window) do ask[i] = all[pos + o - 1] end
      local found = redis.call(src.cmd, src.key, unpack(ask))
      local still = {}
      for i, o in ipairs(window) do
        if not is_live(src, found[i]) then still[#still + 1] = o end
      end
      window = still
    end
    if #window > 0 then return window[1] - 1 end  -- the first offset no set holds
    at, width = at + width, width * 4
  end
  return m
end

local out = {}
for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
  -- most replicas miss the first block: one cheap check (the LRU holds every entry)
  local l, c, pin, x, t = replica_keys(name)
  if redis.call('ZSCORE', l, all[1]) then
    -- the state sets this replica uses, the biggest first (it answers most blocks)
    local expiring = {key = t, cmd = 'SMISMEMBER', size = 'SCARD'}
    if redis.call('ZCOUNT', x, '-inf', now) > 0 then
      -- some ran out and no write has purged them yet: read the expiries themselves
      expiring = {key = x, cmd = 'ZMSCORE', size = 'ZCARD', expiring = true}
    end
    local sources = {}
    for _, src in ipairs({{key = c, cmd = 'SMISMEMBER', size = 'SCARD'},
                          {key = pin, cmd = 'SMISMEMBER', size = 'SCARD'}, expiring}) do
      src.count = redis.call(src.size, src.key)
      if src.count > 0 then sources[#sources + 1] = src end
    end
    table.sort(sources, function(a, b) return a.count > b.count end)
    local depth, pos, size = 0, 1, 32
    while pos <= n do
      local last = math.min(n, pos + size - 1)
      local d = leading_live(sources, pos, last)
      depth = depth + d
      if d < last - pos + 1 then break end
      pos = last + 1
      size = math.min(size * 4, 1024)
    end
    if depth > 0 then
      out[#out + 1] = name
      out[#out + 1] = depth
    end
  end
end
return out
"""

_ADD_REPLICA = _PRELUDE + r"""
local cap = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], NAME, cap)
redis.call('HSET', P .. ':ev', NAME, ARGV[5])
purge(now_ms())
evict(cap)
keep_all()
return 1
"""

_REMOVE_REPLICA = _PRELUDE + r"""
redis.call('UNLINK', L, C, PIN, X, T)
redis.call('HDEL', KEYS[1], NAME)
redis.call('HDEL', P .. ':ev', NAME)
return 1
"""

# Returns 0 when the replica is not registered (Redis lost the registry): nothing is written.
_RECORD_PREDICTION = _PRELUDE + r"""
local blob, ttl = ARGV[4], tonumber(ARGV[5])
local cap = redis.call('HGET', KEYS[1], NAME)
local n = #blob / 8
if not cap then return 0 end
if n == 0 then return 1 end
local now = now_ms()
purge(now)
local expiring = redis.call('HGET', P .. ':ev', NAME) == '1'
local has_confirmed = redis.call('EXISTS', C) == 1
-- a confirmed entry stays confirmed; anything else becomes (or is renewed as) a prediction
for s = 1, n, CHUNK do
  local chunk = members(blob, s, math.min(n, s + CHUNK - 1))
  local predicted = chunk
  if has_confirmed then
    local confirmed = redis.call('SMISMEMBER', C, unpack(chunk))
    predicted = {}
    for j = 1, #chunk do
      if confirmed[j] == 0 then predicted[#predicted + 1] = chunk[j] end
    end
  end
  if #predicted > 0 then
    if expiring then
      local args = {}
      for j = 1, #predicted do
        args[2 * j - 1] = now + ttl
        args[2 * j] = predicted[j]
      end
      redis.call('ZADD', X, unpack(args))
      redis.call('SADD', T, unpack(predicted))
      in_chunks('SREM', PIN, predicted)  -- only if the replica gained events since
    else
      redis.call('SADD', PIN, unpack(predicted))
      in_chunks('ZREM', X, predicted)  -- only if the replica lost its events since
      in_chunks('SREM', T, predicted)
    end
  end
end
touch_all(blob, n)
evict(tonumber(cap))
keep_all()  -- last: the keys exist now
return 1
"""

_CONFIRM = _PRELUDE + r"""
local blob = ARGV[4]
local cap = redis.call('HGET', KEYS[1], NAME)
local n = #blob / 8
if not cap then return 0 end
if n == 0 then return 1 end
purge(now_ms())
for s = 1, n, CHUNK do
  local chunk = members(blob, s, math.min(n, s + CHUNK - 1))
  redis.call('SADD', C, unpack(chunk))
  in_chunks('ZREM', X, chunk)
  in_chunks('SREM', T, chunk)
  in_chunks('SREM', PIN, chunk)
end
touch_all(blob, n)
evict(tonumber(cap))
keep_all()  -- last: the keys exist now
return 1
"""

_REMOVE = _PRELUDE + r"""
local blob = ARGV[4]
local gone = members(blob, 1, #blob / 8)
in_chunks('ZREM', L, gone)
unstate(gone)
return 1
"""

_CLEAR_REPLICA = _PRELUDE + r"""
redis.call('UNLINK', L, C, PIN, X, T)
return 1
"""

_DROP_CONFIRMED = _PRELUDE + r"""
in_chunks('ZREM', L, redis.call('SMEMBERS', C))
redis.call('UNLINK', C)
return 1
"""

_ENTRY_COUNT = _PRELUDE + r"""
return redis.call('ZCARD', L) - redis.call('ZCOUNT', X, '-inf', now_ms())
"""

# The store's epoch: a token set when the store has none (a new, restarted or flushed Redis),
# returned as found; every key of the named replicas, the registry and the epoch live KEEP ms more.
_REFRESH = _COMMON + r"""
local E = P .. ':epoch'
local epoch = redis.call('GET', E)
if not epoch then
  epoch = ARGV[3]
  redis.call('SET', E, epoch)
end
keep({E, KEYS[1], P .. ':ev', P .. ':seq'})
for i = 4, #ARGV do keep({replica_keys(ARGV[i])}) end
return epoch
"""


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
