-- index_scrub: clear the bits of retired members from one page of an index shard (run
-- by `gc` after members left, so their ids can be handed out again); deletes fields
-- left with no bit set.
--
-- KEYS[1]  pcr:{index-03.2}:blocks     an index shard (HASH block hash -> hex bitmap)
-- ARGV[1]  "0"                         HSCAN cursor
-- ARGV[2]  "500"                       HSCAN COUNT hint
-- ARGV[3..] retired member ids ("4", "17", ...)
--
-- On the first page (cursor "0") the ids' stamps ("@<id>", lua/index_update.lua) go
-- first: from then on no late update of a superseded owner can set bits under them, so
-- once every page is scrubbed the ids are clean to hand out again. Stamps and values
-- that are not hex bitmaps (anyone who may write the shard could write garbage) are
-- left alone.
--
-- Returns: the next cursor ("0": the shard is done).
-- Calls:   HSCAN, HSET, HDEL
-- A hex digit's value without the bits of `mask` (plain arithmetic, no `bit` library).
local function without(digit_value, mask)
  local result = 0
  for _, b in ipairs({1, 2, 4, 8}) do
    if math.floor(digit_value / b) % 2 == 1 and math.floor(mask / b) % 2 == 0 then
      result = result + b
    end
  end
  return result
end

local clear = {}  -- hex digit (from the right, 0-based) -> bits to clear there
for i = 3, #ARGV do
  local id = tonumber(ARGV[i])
  local digit = math.floor(id / 2)
  local bits = (id % 2 == 0) and 3 or 12
  local old = clear[digit] or 0
  if old ~= bits and old ~= 15 then
    clear[digit] = old + bits
  end
end
if ARGV[1] == '0' then
  local stamps = {}
  for i = 3, #ARGV do
    stamps[#stamps + 1] = '@' .. ARGV[i]
  end
  for from = 1, #stamps, CHUNK do
    redis.call('HDEL', KEYS[1], unpack(stamps, from, math.min(from + CHUNK - 1, #stamps)))
  end
end
local page = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local entries = page[2]
local sets, dels = {}, {}
for j = 1, #entries, 2 do
  local value = entries[j + 1]
  local n, touched = #value, false
  local digits = {}
  if string.find(value, '^%x+$') and string.sub(entries[j], 1, 1) ~= '@' then
    for at = 1, n do
      digits[at] = tonumber(string.sub(value, at, at), 16)
    end
  else
    n = 0  -- a stamp, or garbage: nothing to clear
  end
  for digit, mask in pairs(clear) do
    local at = n - digit
    if at >= 1 then
      local kept = without(digits[at], mask)
      if kept ~= digits[at] then
        digits[at] = kept
        touched = true
      end
    end
  end
  if touched then
    local text = {}
    for at = 1, n do
      text[at] = string.format('%x', digits[at])
    end
    local joined = table.concat(text)
    local first = string.find(joined, '[^0]')
    if first then
      sets[#sets + 1] = entries[j]
      sets[#sets + 1] = string.sub(joined, first)
    else
      dels[#dels + 1] = entries[j]
    end
  end
end
for from = 1, #sets, CHUNK do
  redis.call('HSET', KEYS[1], unpack(sets, from, math.min(from + CHUNK - 1, #sets)))
end
for from = 1, #dels, CHUNK do
  redis.call('HDEL', KEYS[1], unpack(dels, from, math.min(from + CHUNK - 1, #dels)))
end
return page[1]
