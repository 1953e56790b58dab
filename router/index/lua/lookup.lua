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
