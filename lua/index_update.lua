-- index_update: add or drop one member's bits in the fleet index, the derived view
-- routers score from: per block hash, which live namespaces hold it (registry/fleet.py).
-- A field's value is a bitmap in hex, most significant digit first, without leading
-- zeros: bit 2*id says the member of local id `id` holds the block's KV, bit 2*id+1 its
-- Mamba state. A field whose bits are all clear is deleted. Setting a set bit or clearing a clear one
-- changes nothing, so a re-sent copy is harmless.
--
-- KEYS[1..k]  pcr:{index-03.2}:blocks   index shards (HASH block hash -> hex bitmap): the
--                                      shard of the member's group (registry/fleet.py)
-- ARGV[1]  "17"                        the member's local id in its group (id // 16)
-- ARGV[2]  "kv+" | "kv-" | "mamba+" | "mamba-" | "stamp"
--          set the KV bit | clear the KV bit, and the Mamba bit where the KV bit was set
--          (evict_kv cascades only to the Mamba entries of KV entries it removed) |
--          set | clear the Mamba bit | stamp the id with the epoch on every key
-- ARGV[3]  "1733..."                   the writer's owner epoch; '' for a writer that
--                                      owns nothing (an operator)
-- ARGV[4..] per key in order: the number of hashes, then those hashes ("3", "881", ...)
--
-- Fencing. Each shard holds a stamp per member id, field "@<id>" -> the epoch of the
-- ownership the id was handed to, written by the owner ("stamp") when it joins or
-- reserves the id, deleted by index_scrub.lua when the id is retired and scrubbed. A
-- change is applied on a shard only while the id's stamp there is the writer's epoch
-- (for an operator: while there is one): a superseded owner that wakes up after gc
-- freed its id, or after the id went to another namespace, cannot set bits under it.
--
-- Returns: integer, the number of fields changed; an error reply STALE_MEMBER when some
-- shard refused the change (the others applied it): the writer rebuilds its bits.
-- Calls:   HGET, HMGET, HSET, HDEL
local id = tonumber(ARGV[1])
local digit = math.floor(id / 2)  -- which hex digit, counted from the right from 0
local low = (id % 2 == 0) and 1 or 4  -- the member's KV bit inside that digit
local change = ARGV[2]

-- What one hex digit becomes under each change, for each of the 16 it can be (in the
-- order 0-9a-f), when the member's KV bit is 1 (even ids) or 4 (odd ids): written out
-- here rather than worked out per call, which cost more than editing 16 fields. kv-
-- clears the Mamba bit only where the KV bit was set: evict_kv cascades only to the
-- Mamba entries of KV entries it removed (a Mamba state registered without its KV block
-- stays in the maps).
local DIGITS = {
  ['kv+'] = {'1133557799bbddff', '45674567cdefcdef'},
  ['kv-'] = {'0020446488a8ccec', '0123012389ab0123'},
  ['mamba+'] = {'23236767ababefef', '89abcdef89abcdef'},
  ['mamba-'] = {'010145458989cdcd', '0123456701234567'},
}
local epoch = ARGV[3]
local stamp_field = '@' .. ARGV[1]
if change == 'stamp' then
  for k = 1, #KEYS do
    redis.call('HSET', KEYS[k], stamp_field, epoch)
  end
  return #KEYS
end
local row = DIGITS[change]
if not row then
  return redis.error_reply('BAD_CHANGE index_update: unknown change ' .. tostring(change))
end
local map = row[low == 1 and 1 or 2]
local set_mask = (change == 'kv+' or change == 'mamba+') and 1 or 0  -- sets a bit
local HEX, UPPER = '0123456789abcdef', '0123456789ABCDEF'
local becomes = {}
for d = 1, 16 do
  local to = string.sub(map, d, d)
  becomes[string.sub(HEX, d, d)] = to
  becomes[string.sub(UPPER, d, d)] = to
end
-- A field that did not exist, after a change that sets a bit.
local fresh = becomes['0'] .. string.rep('0', digit)

-- The bitmap `value` (or nil: no field) after the change; false when unchanged, '' when
-- no bit is left.
local function changed(value)
  if not value then
    return set_mask ~= 0 and fresh
  end
  local n = #value
  if n <= digit then
    if set_mask == 0 then
      return false
    end
    return becomes['0'] .. string.rep('0', digit - n) .. value
  end
  local at = n - digit
  local old = string.sub(value, at, at)
  local new = becomes[old]
  if not new or new == old then
    return false  -- unchanged (or not a hex digit: left alone)
  end
  value = string.sub(value, 1, at - 1) .. new .. string.sub(value, at + 1)
  if at == 1 and new == '0' then
    local first = string.find(value, '[^0]')
    return first and string.sub(value, first) or ''
  end
  return value
end

local count, refused = 0, 0
local at = 4
for k = 1, #KEYS do
  local n = tonumber(ARGV[at])
  local stamp = redis.call('HGET', KEYS[k], stamp_field)
  if not stamp or (epoch ~= '' and stamp ~= epoch) then
    refused = refused + 1
  else
    for first = at + 1, at + n, CHUNK do
      local last = math.min(first + CHUNK - 1, at + n)
      local values = redis.call('HMGET', KEYS[k], unpack(ARGV, first, last))
      local sets, dels = {}, {}
      for j = 1, last - first + 1 do
        local value = changed(values[j])
        if value then
          if value == '' then
            dels[#dels + 1] = ARGV[first + j - 1]
          else
            sets[#sets + 1] = ARGV[first + j - 1]
            sets[#sets + 1] = value
          end
        end
      end
      for from = 1, #sets, CHUNK do  -- 2 values per field: unpack stays chunked
        redis.call('HSET', KEYS[k], unpack(sets, from, math.min(from + CHUNK - 1, #sets)))
      end
      if #dels > 0 then
        redis.call('HDEL', KEYS[k], unpack(dels))
      end
      count = count + #sets / 2 + #dels
    end
  end
  at = at + n + 1
end
if refused > 0 then
  return redis.error_reply('STALE_MEMBER index_update: member ' .. ARGV[1]
    .. ' is not stamped with epoch "' .. epoch .. '" on ' .. refused .. ' of '
    .. #KEYS .. ' shards (superseded, or the stamp was lost)')
end
return count
