return redis.call('ZCARD', L) - redis.call('ZCOUNT', X, '-inf', now_ms())
