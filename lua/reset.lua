-- reset: drop every KV and Mamba entry of the namespace in one step; a 'clear'
-- notice announces the Mamba part. Meta (epoch, incarnation, notice numbers) and the
-- stream stay, so notice numbers keep rising for listeners.
--
-- KEYS[1]  pcr:{node-0}:reply:5f1c2a9b03e1-7   this request's reply record
-- KEYS[2]  pcr:{node-0}:kv                      HASH hash -> KV block id
-- KEYS[3]  pcr:{node-0}:mamba                   HASH hash -> block id with Mamba state
-- KEYS[4]  pcr:{node-0}:meta                    HASH epoch, incarnation, notice_seq
-- KEYS[5]  pcr:{node-0}:mamba-evictions         STREAM of notices, capped
-- ARGV[1]  "1796024288853123482" or ""          the caller's owner epoch ('' = not an owner)
-- ARGV[2]  "5f1c2a9b03e1-7"                     request id
-- ARGV[3]  "30000"                              how long the reply is kept (ms)
-- ARGV[4]  pcr:{node-0}:mamba-evicted           channel for the notice
-- ARGV[5]  "1000"                               approximate stream cap (MAXLEN ~)
--
-- Returns: the text of the 'clear' notice, or "" when there was no Mamba entry;
--          error STALE_EPOCH when the caller's epoch was superseded.
-- Calls:   GET, HGET, UNLINK, HSET, HINCRBY, TIME, XADD, PUBLISH, SET
local early = begin_write(KEYS[4])
if early then return early end
local kv_removed = redis.call('UNLINK', KEYS[2])
if redis.call('UNLINK', KEYS[3]) == 0 then
  if kv_removed > 0 then
    record_changes(KEYS[4], {'K'})
  end
  return finish_write('')
end
record_changes(KEYS[4], {'K', 'M'})
return finish_write(publish_notice(KEYS[4], KEYS[5], ARGV[4], ARGV[5], 'clear', ''))
