-- evict_kv: drop KV entries and, in the same step, the Mamba entries of the same
-- hashes (a deregistered KV block can never keep valid Mamba state); announce the
-- Mamba removals with one eviction notice.
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
-- ARGV[6..] distinct hashes to evict ("8815920390121", ...); -1 already filtered out
--
-- Returns: { removed, notice }: removed is the number of hashes removed from KV when
--          that is all of them (the usual case: nothing to list), else their list;
--          notice is "" or the text of the one notice for the cascaded Mamba entries,
--          "<seq>@<incarnation> cascade @<ms> <block_id>:<hash> ..." as published;
--          a retried request returns the first copy's reply;
--          error STALE_EPOCH when the caller's epoch was superseded or its namespace lost.
-- Calls:   GET, HGET, HMGET, HDEL, EXISTS, HSET, HINCRBY, TIME, XADD, PUBLISH, SET
local early = begin_write(KEYS[4])
if early then return early end
local kv_hashes = {}
local removed = remove_fields(KEYS[2], ARGV, 6, #ARGV, kv_hashes, nil)
local notice = ''
local parts = {}
add_part(parts, 'k-', kv_hashes, 1, removed)
if removed > 0 and redis.call('EXISTS', KEYS[3]) == 1 then
  local mamba_hashes, pair_texts = {}, {}
  local cascaded = remove_fields(KEYS[3], kv_hashes, 1, removed, mamba_hashes, pair_texts)
  if cascaded > 0 then
    notice = publish_notice(KEYS[4], KEYS[5], ARGV[4], ARGV[5], 'cascade',
      table.concat(pair_texts, ' '))
    add_part(parts, 'm-', mamba_hashes, 1, cascaded)
  end
end
record_changes(KEYS[4], parts)
local reply = {removed, notice}
if removed ~= #ARGV - 5 then
  reply[1] = kv_hashes
end
return finish_write(reply)
