-- clear_mamba: drop every Mamba entry of the namespace and announce it with one
-- 'clear' notice (no pairs: a listener reconciles its slots against the registry).
--
-- KEYS[1]  pcr:{node-0}:mamba              HASH hash -> block id with Mamba state
-- KEYS[2]  pcr:{node-0}:meta               HASH notice_seq
-- KEYS[3]  pcr:{node-0}:mamba-evictions    STREAM of notices, capped
-- ARGV[1]  pcr:{node-0}:mamba-evicted      channel for the notice
-- ARGV[2]  "10000"                         approximate stream cap (MAXLEN ~)
--
-- Returns: integer, the notice's sequence number, or 0 when there was nothing to drop.
-- Calls:   UNLINK, HINCRBY, XADD, PUBLISH
if redis.call('UNLINK', KEYS[1]) == 0 then
  return 0
end
return publish_notice(KEYS[2], KEYS[3], ARGV[1], ARGV[2], 'clear', '')
