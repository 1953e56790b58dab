-- Shared by the scripts on one replica's entries (after prelude.lua).  ARGV[3] is the replica's name.
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
