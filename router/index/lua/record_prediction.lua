-- Returns 0 when the replica is not registered (Redis lost the registry): nothing is written.
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
