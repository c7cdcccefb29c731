-- reset: drop every KV and Mamba entry of the namespace in one step; a 'clear'
-- notice announces the Mamba part. Meta (epoch, notice sequence) and the stream stay,
-- so notice numbers keep rising for listeners.
--
-- KEYS[1]  pcr:{node-0}:kv                 HASH hash -> KV block id
-- KEYS[2]  pcr:{node-0}:mamba              HASH hash -> block id with Mamba state
-- KEYS[3]  pcr:{node-0}:meta               HASH epoch, notice_seq
-- KEYS[4]  pcr:{node-0}:mamba-evictions    STREAM of notices, capped
-- ARGV[1]  "3" or ""                       the caller's owner epoch ('' = not an owner)
-- ARGV[2]  pcr:{node-0}:mamba-evicted      channel for the notice
-- ARGV[3]  "10000"                         approximate stream cap (MAXLEN ~)
--
-- Returns: the text of the 'clear' notice ("<seq> clear"), or "" when there was no
--          Mamba entry;
--          error STALE_EPOCH when the caller's epoch was superseded.
-- Calls:   HGET, UNLINK, HINCRBY, XADD, PUBLISH
local stale = stale_epoch(KEYS[3], ARGV[1])
if stale then return stale end
redis.call('UNLINK', KEYS[1])
if redis.call('UNLINK', KEYS[2]) == 0 then
  return ''
end
return publish_notice(KEYS[3], KEYS[4], ARGV[2], ARGV[3], 'clear', '')
