-- register_kv: add (hash -> KV block id) entries; last writer wins for an existing hash.
--
-- KEYS[1]  pcr:{node-0}:kv      HASH hash -> KV block id
-- KEYS[2]  pcr:{node-0}:meta    HASH schema, notice_seq
-- ARGV     hash1, block_id1, hash2, block_id2, ...  ("8815920390121", "17", ...)
--          validated and de-duplicated by the caller (last value wins)
--
-- Returns: integer, the number of hashes that were not registered before.
-- Calls:   HSET, HSETNX
redis.call('HSETNX', KEYS[2], 'schema', '1')
local added = 0
local n = #ARGV
for first = 1, n, CHUNK do
  added = added + redis.call('HSET', KEYS[1], unpack(ARGV, first, math.min(first + CHUNK - 1, n)))
end
return added
