-- bridge_apply: apply one or more engine event batches (decoded and hashed by
-- `pcr bridge`) to a bridged namespace, atomically and in order, and record the last
-- engine sequence number applied. A call whose outcome is unknown may be sent again: it
-- applies once (see "Exactly once" below).
--
-- Each engine block is held by some (group, medium) slots of the engine; the holders
-- are one character per slot in `engine-blocks` ('0' not held, 'k' held by an
-- attention group, 'm' held by a Mamba group), then, where a slot holds more than one
-- copy of the block (vLLM does not de-duplicate: a fully cached prompt resent stores
-- its last block again under the same hash, and each copy gets its own BlockRemoved),
-- "<slot>=<copies>" for each such slot, comma-separated. A slot holds the block until
-- its last copy is removed. The KV map lists a block while any attention slot holds
-- it; the Mamba map while the KV map lists it (Mamba state is usable only with its KV
-- prefix) and every Mamba group named by a "G" operation holds it in one of its slots
-- (any Mamba slot, without one). The block id stored is the block's position in its
-- prefix (0 for the first block).
--
-- Exactly once: a call's position is its last engine seq (ARGV[4]) and, for a call that
-- ends inside that seq's batch (a batch too large for one call is written in parts of
-- at most a few hundred blocks, so that no call holds the server long), the batch's
-- blocks written by the end of the call (ARGV[8]). A call whose position is not beyond
-- meta's (bridge_seq, bridge_part; no bridge_part: that batch is complete) was applied
-- already (a resend after a lost reply, or a restarted bridge writing again a batch it
-- had written in part) and changes nothing; a claim drops bridge_seq, so an engine that
-- restarted (seq from 0 again) starts afresh.
--
-- KEYS[1]  pcr:{node-0}:reply:5f1c2a9b03e1-7   this request's reply record
-- KEYS[2]  pcr:{node-0}:kv                      HASH own hash -> block id
-- KEYS[3]  pcr:{node-0}:mamba                   HASH own hash -> block id
-- KEYS[4]  pcr:{node-0}:meta                    HASH epoch, bridge_* fields
-- KEYS[5]  pcr:{node-0}:engine-blocks           HASH engine hash ->
--                                                    "<own> <block id> <digest> <holders>"
--                                                    [" <slot>=<copies>,..."]
-- KEYS[6]  pcr:quota:{node-0}                   STRING the namespace's entry limit, if any
-- ARGV[1]  "1796024288853123482"                the bridge's owner epoch
-- ARGV[2]  "5f1c2a9b03e1-7"                     request id
-- ARGV[3]  "30000"                              how long the reply is kept (ms)
-- ARGV[4]  "1041"                               last engine seq of these batches, or ""
-- ARGV[5]  "vllm"                               engine kind      (meta bridge_engine)
-- ARGV[6]  "tcp://10.0.0.7:5557"                engine endpoint  (meta bridge_endpoint)
-- ARGV[7]  "16"                                 block size, or "" (meta bridge_block_size)
-- ARGV[8]  "512"                                the blocks of seq's batch written by the end
--                                               of this call when it ends inside the batch
--                                               (meta bridge_part), or "": the batch is whole
-- ARGV[9..] operations, in order: one per event, after a "G" when the engine has Mamba groups
--   "S", slot, 'k'|'m', first block id, n, engine hashes, own hashes, digests
--        n blocks stored; the hashes packed at 20 and 19 zero-padded digits each, the
--        32-byte digests as 64 hex characters each
--   "R", slot, n, engine hashes                 n blocks removed (20 digits each)
--   "C"                                         all cleared
--   "G", "1,2 5,6"                              the engine's Mamba groups, each as its
--        slots (comma-separated), for the operations after it
--   (slot: 1..64, the holder character of the event's (group, medium))
--
-- Quota: the call's operations are worked out first and written at the end, so that a
-- call the namespace's limit (KEYS[6]) refuses changes nothing, its position included
-- (the bridge then sends its removals and clears alone, at the same position). A call is
-- refused when it would leave more KV plus Mamba entries than the limit and than the
-- namespace holds, or more engine-blocks entries than the limit and than it holds (an
-- engine could otherwise fill engine-blocks with blocks that no map lists).
--
-- Returns: { blocks newly listed in KV, blocks unlisted from KV, removals of blocks
--            that slot did not hold, clears }; the change record lists each own hash's
--            final state in both maps (after a clear: 'L', read the namespace again);
--          error QUOTA (nothing applied) as above.
-- Calls:   GET, HGET, HSET, HMGET, HDEL, UNLINK, HINCRBY, TIME, PUBLISH (the change record), SET;
--          with a limit set, HLEN
local early = begin_write(KEYS[4])
if early then return early end

-- True if the engine seq `a` is not above `b` (both decimal text below 2^64, no
-- leading zeros: compared as text, Lua's doubles would round them).
local function not_above(a, b)
  return #a < #b or (#a == #b and a <= b)
end
-- Whether the position (seq, part) was reached already (see "Exactly once").
local function reached(seq, part)
  local applied = redis.call('HMGET', KEYS[4], 'bridge_seq', 'bridge_part')
  if not applied[1] then
    return false
  end
  if seq ~= applied[1] then
    return not_above(seq, applied[1])
  end
  if not applied[2] then
    return true  -- that batch was written whole
  end
  return part ~= '' and tonumber(part) <= tonumber(applied[2])
end
if ARGV[4] ~= '' and reached(ARGV[4], ARGV[8]) then
  return finish_write({0, 0, 0, 0})
end
local kv, mamba, blocks = KEYS[2], KEYS[3], KEYS[5]
local stored, removed, unknown, cleared = 0, 0, 0, 0
-- What the call leaves, written at its end: own hash -> block id (listed) or false
-- (unlisted) per map; engine hash -> entry text or false (gone); whether a clear emptied
-- all three first (what was not written since is then gone); whether Mamba state was
-- listed (meta's mamba_seen); and, for the quota, whether each engine hash read from
-- Redis was there before the call.
local in_kv, in_mamba, entries = {}, {}, {}
local emptied, saw_mamba = false, false
local limit, invalid = entry_limit(KEYS[6])
if invalid then return invalid end
local had_entry = limit and {}  -- kept only under a limit

-- The Mamba groups ("G"): per group, its slots; nil: any Mamba slot will do.
local mamba_groups = nil

-- Which maps list a block with these holders: kv, mamba.
local function listed(holders)
  local k = string.find(holders, 'k', 1, true) ~= nil
  if not k or not string.find(holders, 'm', 1, true) then
    return k, false
  end
  for _, slots in ipairs(mamba_groups or {}) do
    local held_here = false
    for _, slot in ipairs(slots) do
      if string.sub(holders, slot, slot) == 'm' then
        held_here = true
        break
      end
    end
    if not held_here then
      return true, false
    end
  end
  return true, true
end

-- The j-th number of a packed argument, without its zero padding.
local function number_at(packed, width, j)
  local last = j * width
  local first = string.find(packed, '[1-9]', last - width + 1)
  if not first or first > last then
    return '0'
  end
  return string.sub(packed, first, last)
end

local function with_char(holders, slot, char)
  if #holders < slot then
    holders = holders .. string.rep('0', slot - #holders)
  end
  return string.sub(holders, 1, slot - 1) .. char .. string.sub(holders, slot + 1)
end

-- HSET / HDEL of collected fields, CHUNK at a time (unpack's limit).
local function flush(command, key, list)
  for first = 1, #list, CHUNK do
    redis.call(command, key, unpack(list, first, math.min(first + CHUNK - 1, #list)))
  end
end

-- HMGET of any number of fields, CHUNK at a time; the values in order.
local function hmget(key, fields)
  local values = {}
  for first = 1, #fields, CHUNK do
    local part = redis.call('HMGET', key, unpack(fields, first, math.min(first + CHUNK - 1, #fields)))
    for j = 1, #part do
      values[first + j - 1] = part[j]
    end
  end
  return values
end

local function engine_hashes(packed, n)
  local list = {}
  for j = 1, n do
    list[j] = number_at(packed, 20, j)
  end
  return list
end

-- An engine-blocks entry's fields: own hash, block id, digest, holders, and the copies
-- of the slots that hold more than one (slot -> copies).
local function parse_entry(text)
  local own, block_id, digest, holders, extra =
    string.match(text, '^(%S+) (%S+) (%S+) (%S*) ?(%S*)$')
  local copies = {}
  for slot, count in string.gmatch(extra or '', '(%d+)=(%d+)') do
    copies[tonumber(slot)] = tonumber(count)
  end
  return own, block_id, digest, holders, copies
end

local function entry_text(own, block_id, digest, holders, copies)
  local text = own .. ' ' .. block_id .. ' ' .. digest .. ' ' .. holders
  local extra = {}
  for slot, count in pairs(copies) do
    if count > 1 then
      extra[#extra + 1] = slot .. '=' .. count
    end
  end
  if #extra > 0 then
    table.sort(extra)
    text = text .. ' ' .. table.concat(extra, ',')
  end
  return text
end

-- Write a table of final values: HSET the kept ones (field, value), HDEL the others;
-- the kept fields and the others, as two lists (the change record's).
local function write_all(key, final)
  local kept, on, off, k, n, m = {}, {}, {}, 0, 0, 0
  for field, value in pairs(final) do
    if value then
      kept[k + 1], kept[k + 2], k = field, value, k + 2
      on[n + 1], n = field, n + 1
    else
      off[m + 1], m = field, m + 1
    end
  end
  flush('HSET', key, kept)
  flush('HDEL', key, off)
  return on, off
end

-- The engine-blocks entries of `engines` as Redis holds them, for those this call has
-- not decided yet (none after a clear); `had_entry` learns which were there.
local function read_entries(engines)
  if emptied then
    return {}
  end
  local olds = hmget(blocks, engines)
  if had_entry then
    for j = 1, #engines do
      if entries[engines[j]] == nil and had_entry[engines[j]] == nil then
        had_entry[engines[j]] = olds[j] and true or false
      end
    end
  end
  return olds
end

-- The entry of `engine` as the call left it so far (a hash may repeat in one event, or
-- come again in a later operation): its text, or false when it is gone.
local function current(olds, engine, j)
  local text = entries[engine]
  if text == nil then
    text = olds[j] or false
  end
  return text
end

local function held(holders, slot)
  return holders ~= nil and #holders >= slot and string.sub(holders, slot, slot) ~= '0'
end

local i, n_args = 9, #ARGV
while i <= n_args do
  local op = ARGV[i]
  if op == 'S' then
    local slot, kind, first_id, n = tonumber(ARGV[i + 1]), ARGV[i + 2], tonumber(ARGV[i + 3]),
      tonumber(ARGV[i + 4])
    local engines, owns, digests = engine_hashes(ARGV[i + 5], n), ARGV[i + 6], ARGV[i + 7]
    local olds = read_entries(engines)
    for j = 1, n do
      local old, holders, copies = current(olds, engines[j], j), '', {}
      if old then
        local _
        _, _, _, holders, copies = parse_entry(old)
        holders = holders or ''
      end
      local had_k = listed(holders)
      if held(holders, slot) then
        copies[slot] = (copies[slot] or 1) + 1  -- another copy of a block it holds
      else
        holders = with_char(holders, slot, kind)
        copies[slot] = nil
      end
      local own, block_id = number_at(owns, 19, j), tostring(first_id + j - 1)
      entries[engines[j]] = entry_text(own, block_id,
        string.sub(digests, (j - 1) * 64 + 1, j * 64), holders, copies)
      local has_k, has_m = listed(holders)
      if has_k then
        in_kv[own] = block_id
        if not had_k then
          stored = stored + 1
        end
      end
      if has_m then
        in_mamba[own] = block_id
        saw_mamba = true
      end
    end
    i = i + 8
  elseif op == 'R' then
    local slot, n = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
    local engines = engine_hashes(ARGV[i + 3], n)
    local olds = read_entries(engines)
    for j = 1, n do
      local engine = engines[j]
      local old = current(olds, engine, j)
      local own, block_id, digest, holders, copies
      if old then
        own, block_id, digest, holders, copies = parse_entry(old)
      end
      if not own or not held(holders, slot) then
        unknown = unknown + 1
      elseif (copies[slot] or 1) > 1 then
        copies[slot] = copies[slot] - 1  -- another copy still holds it
        entries[engine] = entry_text(own, block_id, digest, holders, copies)
      else
        local had_k, had_m = listed(holders)
        holders = with_char(holders, slot, '0')
        copies[slot] = nil
        local has_k, has_m = listed(holders)
        if string.find(holders, '[km]') then
          entries[engine] = entry_text(own, block_id, digest, holders, copies)
        else
          entries[engine] = false
        end
        if had_k and not has_k then
          in_kv[own] = false
          removed = removed + 1
        end
        if had_m and not has_m then
          in_mamba[own] = false
        end
      end
    end
    i = i + 4
  elseif op == 'C' then
    in_kv, in_mamba, entries, emptied = {}, {}, {}, true
    cleared = cleared + 1
    i = i + 1
  elseif op == 'G' then
    mamba_groups = {}
    for group in string.gmatch(ARGV[i + 1], '%S+') do
      local slots = {}
      for slot in string.gmatch(group, '%d+') do
        slots[#slots + 1] = tonumber(slot)
      end
      mamba_groups[#mamba_groups + 1] = slots
    end
    i = i + 2
  else
    return redis.error_reply('BAD_OPERATION bridge_apply: unknown operation ' .. tostring(op))
  end
end

-- The quota, before anything is written.
-- Of the fields of `final` (field -> value, or false: gone), how many the call adds and
-- removes to the HASH `key`, given which were there before (`had`: field -> bool; the
-- others read here, none after a clear).
local function net_change(key, final, had)
  local unknown_fields = {}
  for field in pairs(final) do
    if had[field] == nil and not emptied then
      unknown_fields[#unknown_fields + 1] = field
    end
  end
  local before = hmget(key, unknown_fields)
  for j = 1, #unknown_fields do
    had[unknown_fields[j]] = before[j] and true or false
  end
  local change = 0
  for field, value in pairs(final) do
    local was = had[field] == true and not emptied
    if value and not was then
      change = change + 1
    elseif not value and was then
      change = change - 1
    end
  end
  return change
end
if limit then
  local kv_n, mamba_n, blocks_n = redis.call('HLEN', kv), redis.call('HLEN', mamba),
    redis.call('HLEN', blocks)
  local base = emptied and 0 or 1  -- after a clear, only what the call wrote since is left
  local refused = over_quota(KEYS[4], limit, kv_n + mamba_n,
    base * (kv_n + mamba_n) + net_change(kv, in_kv, {}) + net_change(mamba, in_mamba, {}),
    'entries')
    or over_quota(KEYS[4], limit, blocks_n, base * blocks_n + net_change(blocks, entries, had_entry),
      'engine blocks')
  if refused then return refused end
end

-- The writes: meta's position and engine, then what the operations left.
local meta = {'bridge_engine', ARGV[5], 'bridge_endpoint', ARGV[6]}
if ARGV[4] ~= '' then
  meta[#meta + 1] = 'bridge_seq'
  meta[#meta + 1] = ARGV[4]
  if ARGV[8] ~= '' then
    meta[#meta + 1] = 'bridge_part'
    meta[#meta + 1] = ARGV[8]
  else
    redis.call('HDEL', KEYS[4], 'bridge_part')
  end
end
if ARGV[7] ~= '' then
  meta[#meta + 1] = 'bridge_block_size'
  meta[#meta + 1] = ARGV[7]
end
redis.call('HSET', KEYS[4], unpack(meta))
if emptied then
  redis.call('UNLINK', kv, mamba, blocks)
end
write_all(blocks, entries)
local kv_on, kv_off = write_all(kv, in_kv)
local mamba_on, mamba_off = write_all(mamba, in_mamba)
if saw_mamba then
  mamba_seen(KEYS[4])
end

local parts = {'L'}  -- after a clear, what the batch left is read again
if cleared == 0 then
  parts = {}
  add_part(parts, 'k-', kv_off, 1, #kv_off)
  add_part(parts, 'k+', kv_on, 1, #kv_on)
  add_part(parts, 'm-', mamba_off, 1, #mamba_off)
  add_part(parts, 'm+', mamba_on, 1, #mamba_on)
end
record_changes(KEYS[4], parts)
return finish_write({stored, removed, unknown, cleared})
