-- match_mamba_farthest: one past the farthest position whose hash has Mamba state.
-- Also serves find_mamba_backoff, whose caller sends only hashes[:search_len].
--
-- KEYS[1]  pcr:{node-0}:mamba             HASH hash -> block id with Mamba state
-- ARGV     "8815920390121", "77123", ...  block hashes in prompt order
--
-- Returns: integer k in [0, #ARGV]: ARGV[k] is the last hash with Mamba state; 0 if none.
-- Calls:   HMGET (backwards, one chunk at a time, stopping at the first hit)
local last = #ARGV
while last >= 1 do
  local first = math.max(1, last - CHUNK + 1)
  local ids = redis.call('HMGET', KEYS[1], unpack(ARGV, first, last))
  for i = last - first + 1, 1, -1 do
    if ids[i] then
      return first + i - 1
    end
  end
  last = first - 1
end
return 0
