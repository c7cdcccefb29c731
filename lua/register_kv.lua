-- register_kv: add (hash -> KV block id) entries; last writer wins for an existing hash.
--
-- KEYS[1]  pcr:{node-0}:reply:5f1c2a9b03e1-7   this request's reply record
-- KEYS[2]  pcr:{node-0}:kv                      HASH hash -> KV block id
-- KEYS[3]  pcr:{node-0}:meta                    HASH epoch (read for fencing), change_seq
-- KEYS[4]  pcr:{node-0}:mamba                   HASH hash -> block id (counted for the quota)
-- KEYS[5]  pcr:quota:{node-0}                   STRING the namespace's entry limit, if any
-- ARGV[1]  "1796024288853123482" or ""          the caller's owner epoch ('' = not an owner)
-- ARGV[2]  "5f1c2a9b03e1-7"                     request id
-- ARGV[3]  "30000"                              how long the reply is kept (ms)
-- ARGV[4..] hash1, block_id1, hash2, block_id2, ...  ("8815920390121", "17", ...)
--          validated and de-duplicated by the caller (last value wins)
--
-- Returns: integer, the number of hashes that were not registered before; a retried
--          request returns the first copy's reply; error STALE_EPOCH when the caller's
--          epoch was superseded or its namespace lost; error QUOTA (nothing applied)
--          when the new hashes would take the namespace's KV plus Mamba entries past its
--          limit (KEYS[5]).
-- Calls:   GET, HGET, HSET, SET, TIME, HINCRBY, PUBLISH (the change record);
--          with a limit set, HLEN and HMGET
local early = begin_write(KEYS[3])
if early then return early end
local n = #ARGV
local refused = registration_refused(KEYS[5], KEYS[3], KEYS[2], KEYS[4], KEYS[2], 4, n)
if refused then return refused end
local added = 0
for first = 4, n, CHUNK do
  added = added + redis.call('HSET', KEYS[2], unpack(ARGV, first, math.min(first + CHUNK - 1, n)))
end
local parts = {}
add_part(parts, 'k+', ARGV, 4, n, 2)
record_changes(KEYS[3], parts)
return finish_write(added)
