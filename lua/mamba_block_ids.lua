-- mamba_block_ids: the block id each hash has Mamba state in, read in one atomic step
-- (a slot pool reconciles its slots against this).
--
-- KEYS[1]  pcr:{node-0}:mamba             HASH hash -> block id with Mamba state
-- ARGV     "8815920390121", "77123", ...  block hashes
--
-- Returns: array as long as ARGV: the block id (bulk string) or nil per hash.
-- Calls:   HMGET
local result = {}
local n = #ARGV
for first = 1, n, CHUNK do
  local last = math.min(first + CHUNK - 1, n)
  local ids = redis.call('HMGET', KEYS[1], unpack(ARGV, first, last))
  for i = 1, last - first + 1 do
    result[first + i - 1] = ids[i]
  end
end
return result
