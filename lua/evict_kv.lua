-- evict_kv: drop KV entries and, in the same step, the Mamba entries of the same
-- hashes (a deregistered KV block can never keep valid Mamba state); announce the
-- Mamba removals with one eviction notice.
--
-- KEYS[1]  pcr:{node-0}:kv                 HASH hash -> KV block id
-- KEYS[2]  pcr:{node-0}:mamba              HASH hash -> block id with Mamba state
-- KEYS[3]  pcr:{node-0}:meta               HASH epoch, notice_seq
-- KEYS[4]  pcr:{node-0}:mamba-evictions    STREAM of notices, capped
-- ARGV[1]  "3" or ""                       the caller's owner epoch ('' = not an owner)
-- ARGV[2]  pcr:{node-0}:mamba-evicted      channel for the notice
-- ARGV[3]  "10000"                         approximate stream cap (MAXLEN ~)
-- ARGV[4..] distinct hashes to evict ("8815920390121", ...); -1 already filtered out
--
-- Returns: { {hashes removed from KV}, {block ids of cascaded Mamba entries},
--            {their hashes}, notice sequence number (0 when no Mamba entry went) };
--          error STALE_EPOCH when the caller's epoch was superseded.
-- Calls:   HGET, HMGET, HDEL, HINCRBY, XADD, PUBLISH
local stale = stale_epoch(KEYS[3], ARGV[1])
if stale then return stale end
local kv_hashes, kv_ids = {}, {}
remove_fields(KEYS[1], ARGV, 4, #ARGV, kv_hashes, kv_ids, nil)
local mamba_hashes, mamba_ids, pair_texts = {}, {}, {}
if #kv_hashes > 0 then
  remove_fields(KEYS[2], kv_hashes, 1, #kv_hashes, mamba_hashes, mamba_ids, pair_texts)
end
local seq = 0
if #mamba_ids > 0 then
  seq = publish_notice(KEYS[3], KEYS[4], ARGV[2], ARGV[3], 'cascade', table.concat(pair_texts, ' '))
end
return {kv_hashes, mamba_ids, mamba_hashes, seq}
