-- live_nodes: the node index's members, for readers to check (registry/fleet/leases.py):
-- each with its score (the lease end its owner last announced, or whatever a node user
-- wrote there: a hint, never the truth) and the server's clock, skipping members that are
-- not valid namespaces (anyone allowed to ZADD the shared index can add garbage; one bad
-- member must not break routing for the fleet). Also lists or removes those invalid
-- members, for `pcr stats` and `pcr gc`.
--
-- KEYS[1]  pcr:nodes    ZSET namespace -> announced lease end (ms)
-- ARGV[1]  "list" | "invalid" | "purge"
--
-- Returns: list: { array of namespace, score (as Redis writes it), namespace, score...,
--          number of invalid members skipped, the server's clock (ms, text) };
--          invalid/purge: { array of invalid members (their first 200 bytes, bytes
--          that are not printable ASCII shown as \xNN), number of them } (purge also
--          removes them).
-- Calls:   TIME, ZRANGEBYSCORE, ZRANGE, ZREM
--
-- A valid member: `well_formed` (lua/_prelude.lua); the client applies the full
-- namespace rules.

local function shown(name)
  if #name > 200 then
    name = string.sub(name, 1, 200)
  end
  return (string.gsub(name, '[%c\128-\255]', function(c)
    return string.format('\\x%02x', string.byte(c))
  end))
end

local mode = ARGV[1]
if mode == 'invalid' or mode == 'purge' then
  local bad = {}
  for _, name in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    if not well_formed(name) then
      bad[#bad + 1] = name
    end
  end
  local listed = {}
  for i = 1, #bad do
    listed[i] = shown(bad[i])
    if mode == 'purge' then
      redis.call('ZREM', KEYS[1], bad[i])
    end
  end
  return {listed, #bad}
end
-- A listing reads every member, a flood of forged ones included: printable ASCII, the
-- usual name, passes one pattern test; well_formed checks the rest byte by byte.
local function listable(name)
  local n = #name
  if n > 0 and n <= 800 and not string.find(name, '[^%w%p]') and not string.find(name, '[{}]') then
    return true
  end
  return well_formed(name)
end

local entries = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '+inf', 'WITHSCORES')
local valid, skipped = {}, 0
for i = 1, #entries, 2 do
  if listable(entries[i]) then
    valid[#valid + 1] = entries[i]
    valid[#valid + 1] = entries[i + 1]
  else
    skipped = skipped + 1
  end
end
return {valid, skipped, digits(now_ms())}
