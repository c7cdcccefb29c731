-- live_nodes: namespaces in the node index whose lease has (not) run out, by the
-- server's clock.
--
-- KEYS[1]  pcr:nodes    ZSET namespace -> lease end (ms)
-- ARGV[1]  "live" | "dead"
--
-- Returns: array of namespaces.
-- Calls:   TIME, ZRANGEBYSCORE
local now = now_ms()
if ARGV[1] == 'dead' then
  return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
end
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
