-- score: how much of a prompt one live node has cached, for routing. Uses the parent
-- chain (if block i is cached, so are blocks before it) to find the KV prefix with a
-- binary search (O(log n) lookups), then scans back from its end for the farthest
-- block that also has Mamba state.
--
-- KEYS[1]  pcr:{node-0}:kv       HASH hash -> KV block id
-- KEYS[2]  pcr:{node-0}:mamba    HASH hash -> block id with Mamba state
-- KEYS[3]  pcr:{node-0}:meta     HASH lease_until
-- ARGV     "8815920390121", ...  block hashes in prompt order
--
-- Returns: -1 when the namespace has no live lease (dead nodes are never scored), else
--          { KV prefix length, Mamba-aware prefix length (<= the KV prefix) }.
-- Calls:   TIME, HGET, HEXISTS, HMGET
local lease_until = redis.call('HGET', KEYS[3], 'lease_until')
if not lease_until or tonumber(lease_until) <= now_ms() then
  return -1
end
local low, high = 0, #ARGV  -- ARGV[1..low] cached; ARGV[high + 1..] not
while low < high do
  local middle = math.floor((low + high + 1) / 2)
  if redis.call('HEXISTS', KEYS[1], ARGV[middle]) == 1 then
    low = middle
  else
    high = middle - 1
  end
end
local last, size = low, 64
while last >= 1 do
  local first = math.max(1, last - size + 1)
  local ids = redis.call('HMGET', KEYS[2], unpack(ARGV, first, last))
  for i = last - first + 1, 1, -1 do
    if ids[i] then
      return {low, first + i - 1}
    end
  end
  last = first - 1
  size = math.min(size * 4, CHUNK)
end
return {low, 0}
