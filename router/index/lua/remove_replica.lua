redis.call('UNLINK', L, C, PIN, X, T)
redis.call('HDEL', KEYS[1], NAME)
redis.call('HDEL', P .. ':ev', NAME)
return 1
