-- match_kv_prefix: block ids of the longest cached prefix of a list of block hashes.
--
-- KEYS[1]  pcr:{node-0}:kv              HASH hash -> KV block id
-- ARGV     "8815920390121", "77123", ...  block hashes in prompt order (decimal strings)
--
-- Returns: array of block ids (bulk strings) for hashes[1..k], where k is the first
--          index whose successor is missing: the prefix stops at the first miss, so a
--          hole in the middle never yields a block id past it.
-- Calls:   HMGET
local result = {}
local size = 0
local n = #ARGV
for first = 1, n, CHUNK do
  local last = math.min(first + CHUNK - 1, n)
  local ids = redis.call('HMGET', KEYS[1], unpack(ARGV, first, last))
  for i = 1, last - first + 1 do
    local id = ids[i]
    if not id then
      return result
    end
    size = size + 1
    result[size] = id
  end
end
return result
