-- live_nodes: the node index's namespaces whose lease has (not) run out, by the server's
-- clock, skipping members that are not valid namespaces (anyone allowed to ZADD the
-- shared index can add garbage; one bad member must not break routing for the fleet).
-- Also lists or removes those invalid members, for `pcr stats` and `pcr gc`.
--
-- KEYS[1]  pcr:nodes    ZSET namespace -> lease end (ms)
-- ARGV[1]  "live" | "dead" | "invalid" | "purge"
--
-- Returns: live/dead: { array of namespaces, number of invalid members skipped };
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
local now = now_ms()
local names
if mode == 'dead' then
  names = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
else
  names = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
end
local valid, skipped = {}, 0
for _, name in ipairs(names) do
  if well_formed(name) then
    valid[#valid + 1] = name
  else
    skipped = skipped + 1
  end
end
return {valid, skipped}
