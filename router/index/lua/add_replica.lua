local cap = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], NAME, cap)
redis.call('HSET', P .. ':ev', NAME, ARGV[5])
purge(now_ms())
evict(cap)
keep_all()
return 1
