-- mirror_apply: a mirrored owner (registry/mirror/) applies a run of its queued writes
-- in one call, in order, with exactly the effects the same writes have when sent one by
-- one through register_kv, evict_kv, register_mamba, evict_mamba, clear_kv, clear_mamba
-- and reset: the same entries, the same notices (numbered, streamed and published one
-- by one, in the same order). What differs is bookkeeping: the whole run is fenced once
-- (its epoch checked once: nothing can change it inside one script) and has one request
-- id, so a re-sent copy of the run returns the first copy's reply and applies nothing.
-- The caller bounds a run (registry/mirror/writes.py CALL_WRITES, CALL_VALUES), so one call
-- holds the server for well under a millisecond (BENCHMARKS.md, the owner's mirror).
--
-- KEYS[1]  pcr:{node-0}:reply:5f1c2a9b03e1-7   this run's reply record
-- KEYS[2]  pcr:{node-0}:kv                      HASH hash -> KV block id
-- KEYS[3]  pcr:{node-0}:mamba                   HASH hash -> block id with Mamba state
-- KEYS[4]  pcr:{node-0}:meta                    HASH epoch, incarnation, notice_seq
-- KEYS[5]  pcr:{node-0}:mamba-evictions         STREAM of notices, capped
-- KEYS[6]  pcr:quota:{node-0}                   STRING the namespace's entry limit, if any
-- ARGV[1]  "1796024288853123482"                the mirrored owner's epoch
-- ARGV[2]  "5f1c2a9b03e1-7"                     request id (of the whole run)
-- ARGV[3]  "30000"                              how long the reply is kept (ms)
-- ARGV[4]  pcr:{node-0}:mamba-evicted           channel for notices
-- ARGV[5]  "1000"                               approximate stream cap (MAXLEN ~)
-- ARGV[6..] the writes, each as an operation code (named in Python by
--          registry/mirror/writes.py Op, which must match these), a count n, then its values:
--          "k" n hash1 id1 .. hash_n id_n   register_kv (distinct hashes)
--          "e" n hash1 .. hash_n            evict_kv (distinct hashes)
--          "m" n hash1 id1 .. hash_n id_n   register_mamba (distinct hashes > 0)
--          "x" n hash1 .. hash_n            evict_mamba (distinct hashes)
--          "K" 0 | "M" 0 | "R" 0            clear_kv | clear_mamba | reset
--          e.g. "k" "1" "8815920390121" "17" "e" "2" "881" "882"
--
-- Returns: { writes applied, notice_seq after the run (text, "" when meta has none) };
--          a re-sent copy returns the first copy's reply; error STALE_EPOCH when the
--          owner was fenced, NAMESPACE_MIRRORED when another mirrored owner holds the
--          namespace, BAD_WRITE (nothing applied) for a malformed run, QUOTA (nothing
--          applied) when the run would leave the namespace more KV plus Mamba entries
--          than its limit (KEYS[6]) and than it holds now.
-- Calls:   GET, HGET, HMGET, HSET, HDEL, EXISTS, UNLINK, HINCRBY, TIME, XADD, PUBLISH, SET;
--          with a limit set, HLEN
local early = begin_write(KEYS[4])
if early then return early end

local n = #ARGV
local PAIRED = {k = true, m = true}
local SINGLE = {e = true, x = true}
local WHOLE = {K = true, M = true, R = true}

-- Check the whole run before writing anything: a malformed one changes nothing.
local at = 6
local registering = 0  -- hash, block id pairs the run registers
while at <= n do
  local code, count = ARGV[at], tonumber(ARGV[at + 1] or '')
  if not count or count < 0 or count ~= math.floor(count) then
    return redis.error_reply('BAD_WRITE mirror_apply: bad count at ARGV[' .. (at + 1) .. ']')
  end
  local width
  if PAIRED[code] then
    width = 2 * count
    registering = registering + count
  elseif SINGLE[code] then
    width = count
  elseif WHOLE[code] and count == 0 then
    width = 0
  else
    return redis.error_reply('BAD_WRITE mirror_apply: unknown write ' .. tostring(code))
  end
  at = at + 2 + width
end
if at ~= n + 1 then
  return redis.error_reply('BAD_WRITE mirror_apply: the last write is cut short')
end

-- The KV plus Mamba entries the run leaves, from `kv_n` and `mamba_n` now, worked out
-- without writing: per map, each hash the run touches is looked up once (HMGET) and
-- followed through the writes; after a clear, a hash not written since is absent.
local function entries_after(kv_n, mamba_n)
  local kv = {key = KEYS[2], n = kv_n, has = {}, empty = false}
  local mamba = {key = KEYS[3], n = mamba_n, has = {}, empty = false}
  local function look_up(map, first, last, step)
    if map.empty then
      return
    end
    local fields = {}
    for i = first, last, step do
      if map.has[ARGV[i]] == nil then
        fields[#fields + 1] = ARGV[i]
      end
    end
    for from = 1, #fields, CHUNK do
      local to = math.min(from + CHUNK - 1, #fields)
      local values = redis.call('HMGET', map.key, unpack(fields, from, to))
      for j = 1, to - from + 1 do
        map.has[fields[from + j - 1]] = values[j] ~= false
      end
    end
  end
  local function put(map, first, last)
    look_up(map, first, last, 2)
    for i = first, last, 2 do
      if not map.has[ARGV[i]] then
        map.has[ARGV[i]] = true
        map.n = map.n + 1
      end
    end
  end
  local function drop(map, hash)
    if map.has[hash] then
      map.has[hash] = false
      map.n = map.n - 1
      return true
    end
    return false
  end
  local function empty(map)
    map.n, map.has, map.empty = 0, {}, true
  end
  local i = 6
  while i <= n do
    local code, count = ARGV[i], tonumber(ARGV[i + 1])
    local first = i + 2
    if code == 'k' or code == 'm' then
      i = first + 2 * count
      put(code == 'k' and kv or mamba, first, i - 1)
    elseif code == 'e' then  -- a KV entry removed takes its Mamba entry along
      i = first + count
      look_up(kv, first, i - 1, 1)
      look_up(mamba, first, i - 1, 1)
      for j = first, i - 1 do
        if drop(kv, ARGV[j]) then
          drop(mamba, ARGV[j])
        end
      end
    elseif code == 'x' then
      i = first + count
      look_up(mamba, first, i - 1, 1)
      for j = first, i - 1 do
        drop(mamba, ARGV[j])
      end
    else
      i = first
      if code ~= 'M' then
        empty(kv)
      end
      if code ~= 'K' then
        empty(mamba)
      end
    end
  end
  return kv.n + mamba.n
end

local limit, invalid = entry_limit(KEYS[6])
if invalid then return invalid end
if limit then
  local kv_n, mamba_n = redis.call('HLEN', KEYS[2]), redis.call('HLEN', KEYS[3])
  local before = kv_n + mamba_n
  if before + registering > limit then  -- else even a run of only new hashes fits
    local refused = over_quota(KEYS[4], limit, before, entries_after(kv_n, mamba_n), 'entries')
    if refused then return refused end
  end
end

-- HSET the pairs ARGV[first..last] into `key` (CHUNK is even: pairs stay whole).
local function put(key, first, last)
  for from = first, last, CHUNK do
    redis.call('HSET', key, unpack(ARGV, from, math.min(from + CHUNK - 1, last)))
  end
end

-- register_kv.lua
local parts = {}  -- the change record of the whole run

local function register_kv(first, last)
  put(KEYS[2], first, last)
  add_part(parts, 'k+', ARGV, first, last, 2)
end

-- evict_kv.lua: KV entries, then the Mamba entries of the hashes removed (one notice).
local function evict_kv(first, last)
  local kv_hashes = {}
  local removed = remove_fields(KEYS[2], ARGV, first, last, kv_hashes, nil)
  add_part(parts, 'k-', kv_hashes, 1, removed)
  if removed > 0 and redis.call('EXISTS', KEYS[3]) == 1 then
    local mamba_hashes, pair_texts = {}, {}
    local cascaded = remove_fields(KEYS[3], kv_hashes, 1, removed, mamba_hashes, pair_texts)
    if cascaded > 0 then
      publish_notice(KEYS[4], KEYS[5], ARGV[4], ARGV[5], 'cascade',
        table.concat(pair_texts, ' '))
      add_part(parts, 'm-', mamba_hashes, 1, cascaded)
    end
  end
end

-- register_mamba.lua: a hash moved to another block id is a 'replace' notice.
local function register_mamba(first, last)
  history(KEYS[4])
  local pair_texts = set_mamba_pairs(KEYS[3], KEYS[4], first, last)
  add_part(parts, 'm+', ARGV, first, last, 2)
  if #pair_texts > 0 then
    publish_notice(KEYS[4], KEYS[5], ARGV[4], ARGV[5], 'replace', table.concat(pair_texts, ' '))
  end
end

-- evict_mamba.lua
local function evict_mamba(first, last)
  local hashes, pair_texts = {}, {}
  local removed = remove_fields(KEYS[3], ARGV, first, last, hashes, pair_texts)
  add_part(parts, 'm-', hashes, 1, removed)
  if removed > 0 then
    publish_notice(KEYS[4], KEYS[5], ARGV[4], ARGV[5], 'evict', table.concat(pair_texts, ' '))
  end
end

-- clear_kv.lua, clear_mamba.lua, reset.lua
local function clear(code)
  if code ~= 'M' then  -- what was emptied: 'K' (clear_kv), 'M' (clear_mamba), both (reset)
    parts[#parts + 1] = 'K'
  end
  if code ~= 'K' then
    parts[#parts + 1] = 'M'
  end
  if code ~= 'M' then
    redis.call('UNLINK', KEYS[2])
  end
  if code ~= 'K' and redis.call('UNLINK', KEYS[3]) == 1 then
    publish_notice(KEYS[4], KEYS[5], ARGV[4], ARGV[5], 'clear', '')
  end
end

local applied = 0
at = 6
while at <= n do
  local code, count = ARGV[at], tonumber(ARGV[at + 1])
  local first = at + 2
  if code == 'k' then
    at = first + 2 * count
    register_kv(first, at - 1)
  elseif code == 'e' then
    at = first + count
    evict_kv(first, at - 1)
  elseif code == 'm' then
    at = first + 2 * count
    register_mamba(first, at - 1)
  elseif code == 'x' then
    at = first + count
    evict_mamba(first, at - 1)
  else
    at = first
    clear(code)
  end
  applied = applied + 1
end
record_changes(KEYS[4], parts)
return finish_write({applied, redis.call('HGET', KEYS[4], 'notice_seq') or ''})
