-- forget_node: drop a namespace from the node index if its lease is still over.
--
-- KEYS[1]  pcr:nodes    ZSET namespace -> lease end (ms)
-- ARGV[1]  "node-0"     namespace
--
-- Returns: integer, 1 if removed, 0 if it was renewed meanwhile (or absent).
-- Calls:   TIME, ZSCORE, ZREM
local lease_until = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not lease_until or tonumber(lease_until) > now_ms() then
  return 0
end
return redis.call('ZREM', KEYS[1], ARGV[1])
