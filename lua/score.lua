-- score: how much of a prompt one live node has cached, for routing. Uses the parent
-- chain (if block i is cached, so are blocks before it) to find the KV prefix with a
-- binary search (O(log n) lookups), then, for hybrid models only, finds the farthest
-- block of that prefix that also has Mamba state: first among the prefix's last 8 hashes
-- (one HMGET: where a checkpoint usually is); then, when the namespace holds few Mamba
-- entries, by looking each of them up in the packed prompt (a substring search),
-- otherwise by HMGETs scanning further back in growing chunks (32, 128, ... hashes),
-- which touches each candidate at most once.
--
-- The hashes come packed in ONE argument, each as 19 zero-padded decimal digits: the
-- router sends the same prompt to many namespaces, and one string is cheap to send and
-- to hand to Lua, while n separate arguments would each become a Lua string. Only the
-- hashes the search touches are cut out of it.
--
-- KEYS[1]  pcr:{node-0}:kv       HASH hash -> KV block id
-- KEYS[2]  pcr:{node-0}:mamba    HASH hash -> block id with Mamba state
-- KEYS[3]  pcr:{node-0}:meta     HASH lease_until, mamba_seen
-- ARGV[1]  "0008815920390121000..."  the prompt's block hashes, 19 digits each
-- ARGV[2]  "1" or "0"                  hybrid: "0" skips the Mamba lookup (reports 0)
--
-- Returns: -1 when the namespace has no live lease (dead nodes are never scored), else
--          { KV prefix length, Mamba-aware prefix length (<= the KV prefix) }, and with
--          hybrid "1" and a KV prefix, a third value: 1 if the namespace held Mamba
--          state since its owner's claim (meta's mamba_seen: a hybrid model's node, which
--          can reuse the Mamba-aware prefix), 0 if never (an attention-only node: it
--          reuses its KV prefix).
-- Calls:   TIME, HGET, HEXISTS, HLEN, HKEYS, HMGET
local WIDTH = 19
local FEW_MAMBA = 16  -- up to this many Mamba entries, look each up in the prompt
local packed = ARGV[1]

-- The i-th hash without its zero padding (a hash is at least 1: a non-zero digit is there).
local function hash_at(i)
  local last = i * WIDTH
  local first = string.find(packed, '[1-9]', last - WIDTH + 1)
  return string.sub(packed, first, last)
end

local meta = redis.call('HMGET', KEYS[3], 'lease_until', 'mamba_seen')
local lease_until = meta[1]
if not lease_until or tonumber(lease_until) <= now_ms() then
  return -1
end
local hybrid_node = meta[2] and 1 or 0  -- it held Mamba state: a hybrid model's node
local low, high = 0, math.floor(#packed / WIDTH)  -- hashes 1..low cached; high+1.. not
while low < high do
  local middle = math.floor((low + high + 1) / 2)
  if redis.call('HEXISTS', KEYS[1], hash_at(middle)) == 1 then
    low = middle
  else
    high = middle - 1
  end
end
if ARGV[2] == '0' or low == 0 then
  return {low, 0}
end
local entries = redis.call('HLEN', KEYS[2])
if entries == 0 then
  return {low, 0, hybrid_node}
end

-- HMGET of the hashes first..last; the farthest position with Mamba state, or nil.
local function farthest_in(first, last)
  local fields = {}
  for i = first, last do
    fields[i - first + 1] = hash_at(i)
  end
  local ids = redis.call('HMGET', KEYS[2], unpack(fields))
  for i = last - first + 1, 1, -1 do
    if ids[i] then
      return first + i - 1
    end
  end
  return nil
end

-- A checkpoint is usually near the end of the prefix: look at the last 8 hashes first.
local last = math.max(0, low - 8)
local found = farthest_in(last + 1, low)
if found then
  return {low, found, hybrid_node}
end
if last == 0 then
  return {low, 0, hybrid_node}
end
if entries <= FEW_MAMBA then
  -- Few entries, none near the end: find each of them in the packed prompt instead of
  -- walking the rest of the prefix.
  local farthest = 0
  for _, field in ipairs(redis.call('HKEYS', KEYS[2])) do
    local padded = string.rep('0', WIDTH - #field) .. field
    local at = string.find(packed, padded, 1, true)
    while at and at <= last * WIDTH do  -- every aligned match before the part looked at
      if (at - 1) % WIDTH == 0 then
        local position = (at - 1) / WIDTH + 1
        if position > farthest then
          farthest = position
        end
      end
      at = string.find(packed, padded, at + 1, true)
    end
  end
  return {low, farthest, hybrid_node}
end
local size = 32
while last >= 1 do
  local first = math.max(1, last - size + 1)
  found = farthest_in(first, last)
  if found then
    return {low, found, hybrid_node}
  end
  last = first - 1
  size = math.min(size * 4, CHUNK)
end
return {low, 0, hybrid_node}
