-- announce: record a namespace's lease end in the node index (never moving it back).
-- The index lets routers and gc find namespaces without scanning the keyspace.
--
-- KEYS[1]  pcr:nodes          ZSET namespace -> lease end (server clock, ms)
-- ARGV[1]  "node-0"           namespace
-- ARGV[2]  "1796024288853"    lease end
--
-- Returns: integer, 1 if the index moved forward, else 0.
-- Calls:   ZSCORE, ZREM, ZADD
local current = redis.call('ZSCORE', KEYS[1], ARGV[1])
if current and tonumber(current) >= tonumber(ARGV[2]) then
  return 0
end
-- ZREM first: Redis refuses a script under maxmemory only at its first write, and ZREM
-- never adds memory, so renewals keep a node announced while an operator frees memory.
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
