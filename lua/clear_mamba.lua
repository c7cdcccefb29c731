-- clear_mamba: drop every Mamba entry of the namespace and announce it with one
-- 'clear' notice (no pairs: every entry registered before it is gone).
--
-- KEYS[1]  pcr:{node-0}:mamba              HASH hash -> block id with Mamba state
-- KEYS[2]  pcr:{node-0}:meta               HASH epoch, notice_seq
-- KEYS[3]  pcr:{node-0}:mamba-evictions    STREAM of notices, capped
-- ARGV[1]  "3" or ""                       the caller's owner epoch ('' = not an owner)
-- ARGV[2]  pcr:{node-0}:mamba-evicted      channel for the notice
-- ARGV[3]  "10000"                         approximate stream cap (MAXLEN ~)
--
-- Returns: the text of the 'clear' notice ("<seq> clear"), or "" when there was nothing;
--          error STALE_EPOCH when the caller's epoch was superseded.
-- Calls:   HGET, UNLINK, HINCRBY, XADD, PUBLISH
local stale = stale_epoch(KEYS[2], ARGV[1])
if stale then return stale end
if redis.call('UNLINK', KEYS[1]) == 0 then
  return ''
end
return publish_notice(KEYS[2], KEYS[3], ARGV[2], ARGV[3], 'clear', '')
