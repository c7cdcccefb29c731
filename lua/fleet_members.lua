-- fleet_members: the fleet index's member table, kept in the node index's slot so that
-- joining, renewing and the live list are each one atomic call. A member id is handed to
-- a namespace when its owner claims it (or rebuilds its index entries) and retired when
-- the owner is superseded or the namespace collected; routers count only the bits of a
-- namespace's current id, and only while its lease is live (registry/fleet.py).
--
-- KEYS[1]  pcr:nodes                ZSET namespace -> lease end (server clock, ms)
-- KEYS[2]  {pcr:nodes}:members      HASH "ns:<namespace>" -> id, "id:<id>" -> namespace,
--                                        "next:<g>" -> the next never-used id of group
--                                        g (below), "version" ->
--                                        changes whenever an entry joins or leaves :live
--                                        (first set from the server's clock in µs, so
--                                        a table rebuilt from empty never repeats one)
-- KEYS[3]  {pcr:nodes}:live         ZSET "<id> <namespace>" of current members -> lease end
-- KEYS[4]  {pcr:nodes}:retired      SET ids whose bits may still be in the index
-- KEYS[5]  {pcr:nodes}:free         SET ids scrubbed from the index, to hand out again
-- ARGV[1]  "join" ns lease_end g    retire ns's id, hand it a new one of group g, record
--                                   the lease -> the new id
--          "reserve" ns g           a new id of group g for ns, not yet its current one
--                                   -> the id
--          "switch" ns id           make a reserved id current, retiring the old one
--                                   -> 1, or 0 when the id is no longer ns's
--          "check" ns id lease_end  record the lease -> 1 if id is still ns's current id
--          "live"                   -> { {"id ns", ...} of live members (malformed entries
--                                        left out), the number of live namespaces in the
--                                        node index }
--          "since" version          for routers that keep the member list:
--                                   -> { the current version, every entry of :live
--                                        (malformed ones left out) or nil when `version`
--                                        is current, the entries whose lease is over,
--                                        the number of live namespaces in the node index }
--          "forget" ns              drop a namespace whose lease is over from the node
--                                   index and retire its id -> 1, or 0 (renewed)
--          "retired"                -> the retired ids, orphaned reservations included
--          "free" id...             retired ids scrubbed from the index -> number freed
--
-- Groups. An id's group is id % 16: its bits live in index shard `group` under the
-- local id id // 16 (registry/fleet.py), so an owner's index upkeep goes to the shard
-- on its own Redis node. Each group hands out its ids separately, smallest free first,
-- which keeps every shard's bitmaps as short as its own members allow. A missing or bad
-- group is group 0 (a standalone server has only that one).
--
-- Calls:   TIME, ZSCORE, ZREM, ZADD, ZRANGE, ZRANGEBYSCORE, ZCOUNT, HGET, HSET, HDEL, HINCRBY,
--          HGETALL, SADD, SREM, SMEMBERS

local nodes, members, live, retired, free = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local mode = ARGV[1]

-- The member list changed (an entry joined or left :live): routers that keep a copy
-- read it again. A missing version starts from the server's clock in µs, so a version
-- a router remembers from before a restart with an empty Redis never comes back.
local function bump()
  local version = redis.pcall('HINCRBY', members, 'version', 1)
  if version == 1 or type(version) ~= 'number' then  -- new, or garbage: start again
    local time = redis.call('TIME')
    redis.call('HSET', members, 'version', time[1] .. string.format('%06d', tonumber(time[2])))
  end
end

-- Record a lease end in a ZSET, never moving it back. ZREM first: it frees memory, so
-- renewals keep working while Redis is at maxmemory. Returns whether `member` is new.
local function record(key, member, lease_end)
  local current = redis.call('ZSCORE', key, member)
  if current and tonumber(current) >= tonumber(lease_end) then
    return false
  end
  redis.call('ZREM', key, member)
  redis.call('ZADD', key, lease_end, member)
  return not current
end

-- The entries of a ZSET range that routers may read: "<digits> <well-formed name>"
-- (anyone who may write :live could write garbage; a client decoding replies as text
-- must never choke). An ASCII name passes one pattern test; only others need the walk.
local function readable(entries)
  local listed = {}
  for _, entry in ipairs(entries) do
    if string.find(entry, '^%d+ [!-z|~]+$') then
      listed[#listed + 1] = entry
    else
      local name = string.match(entry, '^%d+ (.+)$')
      if name and well_formed(name) then
        listed[#listed + 1] = entry
      end
    end
  end
  return listed
end

local function announce(ns, lease_end)
  record(nodes, ns, lease_end)
end

-- ns's current id, if any, stops being current: its bits await a scrub.
local function retire(ns)
  local old = redis.call('HGET', members, 'ns:' .. ns)
  if old then
    redis.call('HDEL', members, 'ns:' .. ns, 'id:' .. old)
    if redis.call('ZREM', live, old .. ' ' .. ns) == 1 then
      bump()
    end
    redis.call('SADD', retired, old)
  end
end

-- Make `id` ns's current id, listed live until the namespace's lease end.
local function make_current(ns, id)
  redis.call('HSET', members, 'ns:' .. ns, id, 'id:' .. id, ns)
  local lease_end = redis.call('ZSCORE', nodes, ns)
  if lease_end and redis.call('ZADD', live, lease_end, id .. ' ' .. ns) == 1 then
    bump()
  end
end

local GROUPS = 16

local function group_of(raw)
  local g = tonumber(raw)
  if g and g >= 0 and g < GROUPS and g == math.floor(g) then
    return g
  end
  return 0
end

-- Ids an earlier version handed out from one counter ("next": ids 0 to next - 1, their
-- bits at positions 2*id, in shard 0 or in every shard) are never reused, and no group's
-- local id starts below that count: no new member's bits can land where an old id's bits
-- may still lie (they are scrubbed under the new reading, not the old one).
-- A new id of `group`: its smallest scrubbed id, else one never used.
local function new_id(ns, group)
  local legacy = tonumber(redis.call('HGET', members, 'next') or '0') or 0
  local best, best_raw
  for _, raw in ipairs(redis.call('SMEMBERS', free)) do
    -- Only ids as this script writes them (anyone who may write the set could write
    -- garbage: "-16", "1e9", "007" are left there).
    local n = string.find(raw, '^[1-9]%d?%d?%d?%d?%d?%d?%d?%d?$') and tonumber(raw)
    if raw == '0' then
      n = 0
    end
    if n and n % GROUPS == group and n >= legacy * GROUPS and (not best or n < best) then
      best, best_raw = n, raw
    end
  end
  local id
  if best then
    redis.call('SREM', free, best_raw)
    id = string.format('%d', best)
  else
    local counter = 'next:' .. group
    if not redis.call('HGET', members, counter) then
      redis.call('HSET', members, counter, legacy)
    end
    local n = redis.pcall('HINCRBY', members, counter, 1)
    if type(n) ~= 'number' or n <= legacy then  -- garbage: start past every id listed
      n = legacy + 1
      local all = redis.call('HGETALL', members)
      for i = 1, #all, 2 do
        local listed = tonumber(string.match(all[i], '^id:(%d+)$') or '')
        if listed and math.floor(listed / GROUPS) + 2 > n then
          n = math.floor(listed / GROUPS) + 2
        end
      end
      redis.call('HSET', members, counter, n)
    end
    id = string.format('%d', (n - 1) * GROUPS + group)
  end
  redis.call('HSET', members, 'id:' .. id, ns)
  return id
end

if mode == 'join' then
  retire(ARGV[2])
  local id = new_id(ARGV[2], group_of(ARGV[4]))
  announce(ARGV[2], ARGV[3])
  make_current(ARGV[2], id)
  return id
elseif mode == 'reserve' then
  return new_id(ARGV[2], group_of(ARGV[3]))
elseif mode == 'switch' then
  local ns, id = ARGV[2], ARGV[3]
  if redis.call('HGET', members, 'id:' .. id) ~= ns then
    return 0
  end
  if redis.call('HGET', members, 'ns:' .. ns) ~= id then
    retire(ns)
    make_current(ns, id)
  end
  return 1
elseif mode == 'check' then
  announce(ARGV[2], ARGV[4])
  if redis.call('HGET', members, 'ns:' .. ARGV[2]) ~= ARGV[3] then
    return 0
  end
  if record(live, ARGV[3] .. ' ' .. ARGV[2], ARGV[4]) then
    bump()  -- the entry was gone (a failover, an operator): put back, listed again
  end
  return 1
elseif mode == 'live' then
  -- One range read: routers parse "id namespace"; the count tells them whether some
  -- live namespace has no id (then they list those the slow way, once).
  local now = '(' .. now_ms()
  return {readable(redis.call('ZRANGEBYSCORE', live, now, '+inf')),
          redis.call('ZCOUNT', nodes, now, '+inf')}
elseif mode == 'since' then
  -- A router's per-decision call: while the member list is the one it holds (the
  -- version it sends), only the entries whose lease is over (usually none) travel.
  local now = now_ms()
  local version = redis.call('HGET', members, 'version') or ''
  if not string.find(version, '^%d+$') then
    version = ''  -- garbage is never sent (a text client must not choke): list every time
  end
  local listed = false
  if version ~= ARGV[2] or version == '' then
    listed = readable(redis.call('ZRANGE', live, 0, -1))
  end
  return {version, listed, readable(redis.call('ZRANGEBYSCORE', live, '-inf', now)),
          redis.call('ZCOUNT', nodes, '(' .. now, '+inf')}
elseif mode == 'forget' then
  local ns = ARGV[2]
  local lease_end = redis.call('ZSCORE', nodes, ns)
  if lease_end and tonumber(lease_end) > now_ms() then
    return 0
  end
  redis.call('ZREM', nodes, ns)
  retire(ns)
  return 1
elseif mode == 'retired' then
  -- Reservations whose namespace moved on (an owner that died while rebuilding) are
  -- retired here too, so their ids are scrubbed and handed out again.
  local all = redis.call('HGETALL', members)
  local current = {}
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 3) == 'ns:' then
      current[all[i + 1]] = true
    end
  end
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 3) == 'id:' then
      local id = string.sub(all[i], 4)
      if not current[id] then
        redis.call('HDEL', members, all[i])
        redis.call('SADD', retired, id)
      end
    end
  end
  return redis.call('SMEMBERS', retired)
elseif mode == 'free' then
  local freed = 0
  for i = 2, #ARGV do
    if redis.call('SREM', retired, ARGV[i]) == 1 then
      redis.call('SADD', free, ARGV[i])
      freed = freed + 1
    end
  end
  return freed
end
return redis.error_reply('BAD_MODE fleet_members: unknown mode ' .. tostring(mode))
