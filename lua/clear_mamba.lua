-- clear_mamba: drop every Mamba entry of the namespace and announce it with one
-- 'clear' notice (no pairs: every entry registered before it is gone).
--
-- KEYS[1]  pcr:{node-0}:reply:5f1c2a9b03e1-7   this request's reply record
-- KEYS[2]  pcr:{node-0}:mamba                   HASH hash -> block id with Mamba state
-- KEYS[3]  pcr:{node-0}:meta                    HASH epoch, incarnation, notice_seq
-- KEYS[4]  pcr:{node-0}:mamba-evictions         STREAM of notices, capped
-- ARGV[1]  "1796024288853123482" or ""          the caller's owner epoch ('' = not an owner)
-- ARGV[2]  "5f1c2a9b03e1-7"                     request id
-- ARGV[3]  "30000"                              how long the reply is kept (ms)
-- ARGV[4]  pcr:{node-0}:mamba-evicted           channel for the notice
-- ARGV[5]  "1000"                               approximate stream cap (MAXLEN ~)
--
-- Returns: the text of the 'clear' notice ("<seq>@<incarnation> clear @<ms>"), or "" when
--          there was nothing; error STALE_EPOCH when the caller's epoch was superseded.
-- Calls:   GET, HGET, UNLINK, HSET, HINCRBY, TIME, XADD, PUBLISH, SET
local early = begin_write(KEYS[3])
if early then return early end
if redis.call('UNLINK', KEYS[2]) == 0 then
  return finish_write('')
end
record_changes(KEYS[3], {'M'})
return finish_write(publish_notice(KEYS[3], KEYS[4], ARGV[4], ARGV[5], 'clear', ''))
