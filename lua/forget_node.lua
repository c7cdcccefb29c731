-- forget_node: drop namespaces from the node index (`pcr gc`, after their keys went),
-- each only if its score is still the one gc read: a namespace claimed again since then
-- announced a new lease end (ZADD GT moved it), and keeps its member.
--
-- KEYS[1]  pcr:nodes                    ZSET namespace -> announced lease end (ms)
-- ARGV[1]  "node-0"                     namespace
-- ARGV[2]  "1796024288853"              its score as gc read it (text, as Redis wrote it)
-- ARGV[3..]                             further (namespace, score) pairs
--
-- Returns: integer, how many members were removed.
-- Calls:   ZSCORE, ZREM
local removed = 0
for i = 1, #ARGV, 2 do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return removed
