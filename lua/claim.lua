-- claim: a (re)starting owner takes a new epoch for its namespace. In the same step it
-- drops the previous incarnation's entries (its GPU blocks are gone) and starts a lease,
-- so a late write from the old process fails with STALE_EPOCH and resurrects nothing.
--
-- KEYS[1]  pcr:{node-0}:kv                 HASH hash -> KV block id
-- KEYS[2]  pcr:{node-0}:mamba              HASH hash -> block id with Mamba state
-- KEYS[3]  pcr:{node-0}:meta               HASH schema, epoch, notice_seq, lease_until
-- KEYS[4]  pcr:{node-0}:mamba-evictions    STREAM of notices, capped
-- ARGV[1]  pcr:{node-0}:mamba-evicted      channel for the 'clear' notice
-- ARGV[2]  "10000"                         approximate stream cap (MAXLEN ~)
-- ARGV[3]  "10000"                         lease length in milliseconds
--
-- Returns: { new epoch, lease end (server clock, ms) }
-- Calls:   TIME, HINCRBY, HSETNX, HSET, UNLINK, XADD, PUBLISH
local epoch = redis.call('HINCRBY', KEYS[3], 'epoch', 1)
redis.call('HSETNX', KEYS[3], 'schema', '1')
redis.call('UNLINK', KEYS[1])
if redis.call('UNLINK', KEYS[2]) == 1 then
  publish_notice(KEYS[3], KEYS[4], ARGV[1], ARGV[2], 'clear', '')
end
local lease_until = now_ms() + tonumber(ARGV[3])
redis.call('HSET', KEYS[3], 'lease_until', lease_until)
return {epoch, lease_until}
