-- mirror_resync: a mirrored owner (registry/mirror.py) rewrites its namespace from its
-- local mirror after its write-behind queue overflowed (Redis was away too long and the
-- backlog was dropped): in one fenced step the KV and Mamba maps are replaced by the
-- mirror's, and a 'clear' notice tells listeners to reconcile. The notice numbers follow
-- the mirror's: notice_seq is set to ARGV[6] (the mirror's last number plus one, a number
-- never published), so the clear (ARGV[6] + 1) always follows a gap and a listener
-- reconciles against the maps instead of freeing every slot.
--
-- KEYS[1]  pcr:{node-0}:reply:5f1c2a9b03e1-7   this request's reply record
-- KEYS[2]  pcr:{node-0}:kv                      HASH hash -> KV block id
-- KEYS[3]  pcr:{node-0}:mamba                   HASH hash -> block id with Mamba state
-- KEYS[4]  pcr:{node-0}:meta                    HASH epoch, incarnation, notice_seq
-- KEYS[5]  pcr:{node-0}:mamba-evictions         STREAM of notices, capped
-- KEYS[6]  pcr:quota:{node-0}                   STRING the namespace's entry limit, if any
-- ARGV[1]  "1796024288853123482"                the mirrored owner's epoch
-- ARGV[2]  "5f1c2a9b03e1-7"                     request id
-- ARGV[3]  "30000"                              how long the reply is kept (ms)
-- ARGV[4]  pcr:{node-0}:mamba-evicted           channel for the 'clear' notice
-- ARGV[5]  "1000"                               approximate stream cap (MAXLEN ~)
-- ARGV[6]  "1796024288853140"                   notice_seq to continue from (text)
-- ARGV[7]  "2"                                  n: the number of KV pairs that follow
-- ARGV[8..7+2n]  hash1, block_id1, ...          the mirror's KV map
-- ARGV[8+2n..]   hash1, block_id1, ...          the mirror's Mamba map
--
-- Returns: the text of the 'clear' notice; error STALE_EPOCH when the owner was fenced;
--          error QUOTA (nothing applied) when the mirror holds more entries than the
--          namespace's limit (KEYS[6]) and than the namespace holds now.
-- Calls:   GET, HGET, HMGET, TIME, UNLINK, HSET, HINCRBY, XADD, PUBLISH, SET; with a limit
--          set, HLEN
local early = begin_write(KEYS[4])
if early then return early end
local kv_end = 7 + 2 * tonumber(ARGV[7])
local limit, invalid = entry_limit(KEYS[6])
if invalid then return invalid end
if limit then
  local refused = over_quota(KEYS[4], limit, entry_count(KEYS[2], KEYS[3]), (#ARGV - 7) / 2,
    'entries')
  if refused then return refused end
end
redis.call('UNLINK', KEYS[2], KEYS[3])
local function put(key, from, to)
  for first = from, to, CHUNK do
    local last = math.min(first + CHUNK - 1, to)
    redis.call('HSET', key, unpack(ARGV, first, last))
  end
end
put(KEYS[2], 8, kv_end)
put(KEYS[3], kv_end + 1, #ARGV)
history(KEYS[4])
redis.call('HSET', KEYS[4], 'notice_seq', ARGV[6])
record_changes(KEYS[4], {'L'})
return finish_write(publish_notice(KEYS[4], KEYS[5], ARGV[4], ARGV[5], 'clear', ''))
