-- score: how much of a prompt one live node has cached, for routing. Uses the parent
-- chain (if block i is cached, so are blocks before it) to find the KV prefix with a
-- binary search (O(log n) lookups), then scans back from its end for the farthest
-- block that also has Mamba state.
--
-- The hashes come packed in ONE argument, each as 19 zero-padded decimal digits: the
-- router sends the same prompt to many namespaces, and one string is cheap to send and
-- to hand to Lua, while n separate arguments would each become a Lua string. Only the
-- hashes the search touches are cut out of it.
--
-- KEYS[1]  pcr:{node-0}:kv       HASH hash -> KV block id
-- KEYS[2]  pcr:{node-0}:mamba    HASH hash -> block id with Mamba state
-- KEYS[3]  pcr:{node-0}:meta     HASH lease_until
-- ARGV[1]  "0008815920390121000..."  the prompt's block hashes, 19 digits each
--
-- Returns: -1 when the namespace has no live lease (dead nodes are never scored), else
--          { KV prefix length, Mamba-aware prefix length (<= the KV prefix) }.
-- Calls:   TIME, HGET, HEXISTS, HMGET
local WIDTH = 19
local packed = ARGV[1]

local function hash_at(i)
  local digits = string.sub(packed, (i - 1) * WIDTH + 1, i * WIDTH)
  return (string.gsub(digits, '^0+', ''))
end

local lease_until = redis.call('HGET', KEYS[3], 'lease_until')
if not lease_until or tonumber(lease_until) <= now_ms() then
  return -1
end
local low, high = 0, math.floor(#packed / WIDTH)  -- hashes 1..low cached; high+1.. not
while low < high do
  local middle = math.floor((low + high + 1) / 2)
  if redis.call('HEXISTS', KEYS[1], hash_at(middle)) == 1 then
    low = middle
  else
    high = middle - 1
  end
end
local last, size = low, 8
while last >= 1 do
  local first = math.max(1, last - size + 1)
  local fields = {}
  for i = first, last do
    fields[i - first + 1] = hash_at(i)
  end
  local ids = redis.call('HMGET', KEYS[2], unpack(fields))
  for i = last - first + 1, 1, -1 do
    if ids[i] then
      return {low, first + i - 1}
    end
  end
  last = first - 1
  size = math.min(size * 4, CHUNK)
end
return {low, 0}
