-- The start of every script (router/index/redis_index.py joins the parts).  Every script's
-- arguments start with P (the base), the TTL of the keys it writes in ms (KEEP), then its own.
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
