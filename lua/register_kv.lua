-- register_kv: add (hash -> KV block id) entries; last writer wins for an existing hash.
--
-- KEYS[1]  pcr:{node-0}:kv      HASH hash -> KV block id
-- KEYS[2]  pcr:{node-0}:meta    HASH epoch (read for fencing)
-- ARGV[1]  "3" or ""            the caller's owner epoch ('' = not an owner)
-- ARGV[2..] hash1, block_id1, hash2, block_id2, ...  ("8815920390121", "17", ...)
--          validated and de-duplicated by the caller (last value wins)
--
-- Returns: integer, the number of hashes that were not registered before;
--          error STALE_EPOCH when the caller's epoch was superseded.
-- Calls:   HGET, HSET
local stale = stale_epoch(KEYS[2], ARGV[1])
if stale then return stale end
local n = #ARGV
if n <= CHUNK + 1 then
  return redis.call('HSET', KEYS[1], unpack(ARGV, 2))
end
local added = 0
for first = 2, n, CHUNK do
  added = added + redis.call('HSET', KEYS[1], unpack(ARGV, first, math.min(first + CHUNK - 1, n)))
end
return added
