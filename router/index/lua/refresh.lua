-- The store's epoch: a token set when the store has none (a new, restarted or flushed Redis),
-- returned as found; every key of the named replicas, the registry and the epoch live KEEP ms more.
local E = P .. ':epoch'
local epoch = redis.call('GET', E)
if not epoch then
  epoch = ARGV[3]
  redis.call('SET', E, epoch)
end
keep({E, KEYS[1], P .. ':ev', P .. ':seq'})
for i = 4, #ARGV do keep({replica_keys(ARGV[i])}) end
return epoch
