local blob = ARGV[4]
local gone = members(blob, 1, #blob / 8)
in_chunks('ZREM', L, gone)
unstate(gone)
return 1
