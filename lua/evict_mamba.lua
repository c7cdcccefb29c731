-- evict_mamba: drop Mamba entries and announce them with one eviction notice.
--
-- KEYS[1]  pcr:{node-0}:mamba              HASH hash -> block id with Mamba state
-- KEYS[2]  pcr:{node-0}:meta               HASH notice_seq
-- KEYS[3]  pcr:{node-0}:mamba-evictions    STREAM of notices, capped
-- ARGV[1]  pcr:{node-0}:mamba-evicted      channel for the notice
-- ARGV[2]  "10000"                         approximate stream cap (MAXLEN ~)
-- ARGV[3..] distinct hashes to evict ("8815920390121", ...); -1 already filtered out
--
-- Returns: { {hashes removed}, {their block ids}, notice sequence number (0 if none) }
-- Calls:   HMGET, HDEL, HINCRBY, XADD, PUBLISH
local hashes, ids, pair_texts = {}, {}, {}
remove_fields(KEYS[1], ARGV, 3, #ARGV, hashes, ids, pair_texts)
local seq = 0
if #ids > 0 then
  seq = publish_notice(KEYS[2], KEYS[3], ARGV[1], ARGV[2], 'evict', table.concat(pair_texts, ' '))
end
return {hashes, ids, seq}
