-- evict_mamba: drop Mamba entries and announce them with one eviction notice.
--
-- KEYS[1]  pcr:{node-0}:mamba              HASH hash -> block id with Mamba state
-- KEYS[2]  pcr:{node-0}:meta               HASH epoch, notice_seq
-- KEYS[3]  pcr:{node-0}:mamba-evictions    STREAM of notices, capped
-- ARGV[1]  "3" or ""                       the caller's owner epoch ('' = not an owner)
-- ARGV[2]  pcr:{node-0}:mamba-evicted      channel for the notice
-- ARGV[3]  "10000"                         approximate stream cap (MAXLEN ~)
-- ARGV[4..] distinct hashes to evict ("8815920390121", ...); -1 already filtered out
--
-- Returns: the text of the notice, "<seq> evict <block_id>:<hash> ...", which lists what
--          was removed, or "" when nothing was;
--          error STALE_EPOCH when the caller's epoch was superseded.
-- Calls:   HGET, HMGET, HDEL, HINCRBY, XADD, PUBLISH
local stale = stale_epoch(KEYS[2], ARGV[1])
if stale then return stale end
local hashes, pair_texts = {}, {}
if remove_fields(KEYS[1], ARGV, 4, #ARGV, hashes, pair_texts) == 0 then
  return ''
end
return publish_notice(KEYS[2], KEYS[3], ARGV[2], ARGV[3], 'evict', table.concat(pair_texts, ' '))
