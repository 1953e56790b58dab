redis.call('UNLINK', L, C, PIN, X, T)
return 1
