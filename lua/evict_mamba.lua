-- evict_mamba: drop Mamba entries and announce them with one eviction notice.
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
-- ARGV[6..] distinct hashes to evict ("8815920390121", ...); -1 already filtered out
--
-- Returns: the text of the notice, "<seq>@<incarnation> evict @<ms> <block_id>:<hash> ...",
--          which lists what was removed, or "" when nothing was; a retried request
--          returns the first copy's reply;
--          error STALE_EPOCH when the caller's epoch was superseded or its namespace lost.
-- Calls:   GET, HGET, HMGET, HDEL, HSET, HINCRBY, TIME, XADD, PUBLISH, SET
local early = begin_write(KEYS[3])
if early then return early end
local hashes, pair_texts = {}, {}
local notice = ''
local removed = remove_fields(KEYS[2], ARGV, 6, #ARGV, hashes, pair_texts)
if removed > 0 then
  local parts = {}
  add_part(parts, 'm-', hashes, 1, removed)
  record_changes(KEYS[3], parts)
  notice = publish_notice(KEYS[3], KEYS[4], ARGV[4], ARGV[5], 'evict',
    table.concat(pair_texts, ' '))
end
return finish_write(notice)
