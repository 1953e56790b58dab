in_chunks('ZREM', L, redis.call('SMEMBERS', C))
redis.call('UNLINK', C)
return 1
