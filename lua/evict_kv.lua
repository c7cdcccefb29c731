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
-- Returns: { removed, notice }: removed is the number of hashes removed from KV when
--          that is all of them (the usual case: nothing to list), else their list;
--          notice is "" or the text of the one notice for the cascaded Mamba entries,
--          "<seq> cascade <block_id>:<hash> ..." as published;
--          error STALE_EPOCH when the caller's epoch was superseded.
-- Calls:   HGET, HMGET, HDEL, EXISTS, HINCRBY, XADD, PUBLISH
local stale = stale_epoch(KEYS[3], ARGV[1])
if stale then return stale end
local kv_hashes = {}
local removed = remove_fields(KEYS[1], ARGV, 4, #ARGV, kv_hashes, nil)
local notice = ''
if removed > 0 and redis.call('EXISTS', KEYS[2]) == 1 then
  local mamba_hashes, pair_texts = {}, {}
  if remove_fields(KEYS[2], kv_hashes, 1, removed, mamba_hashes, pair_texts) > 0 then
    notice = publish_notice(KEYS[3], KEYS[4], ARGV[2], ARGV[3], 'cascade', table.concat(pair_texts, ' '))
  end
end
if removed == #ARGV - 3 then
  return {removed, notice}
end
return {kv_hashes, notice}
