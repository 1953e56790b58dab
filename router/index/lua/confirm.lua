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
