-- _prelude.lua: shared by every script; registry/transport/scripts.py puts it in front of each
-- script body before loading, so one SCRIPT LOAD still carries one self-contained script.
--
-- Rules every script follows (ARCHITECTURE.md, "Invariants"):
--   * a block hash stays a string from ARGV to reply; Lua numbers are doubles and
--     would round hashes above 2^53, so `tonumber` is never applied to a hash; numbers
--     above 2^53 or over 14 digits (notice numbers, epochs) travel as strings too;
--   * `unpack` is chunked (CHUNK values at a time): Lua's C stack holds about 8,000;
--   * every key comes from KEYS; the channel name is not a key and comes from ARGV (the
--     change records' channel is built from the meta key: record_changes);
--   * a write script opens with WRITE_ARGV: ARGV[1] the caller's owner epoch ('' for a
--     caller that owns nothing, such as an operator), ARGV[2] the request id, ARGV[3]
--     how long (ms) its reply is kept, and KEYS[1] the request's reply key. A re-sent
--     copy of the same request (a client retry after a timeout) returns the reply the
--     first copy recorded and changes nothing; a superseded owner's write changes nothing.

local CHUNK = 4000

-- A notice's pairs are kept in the stream only up to this many bytes: the stream is
-- bounded in bytes as well as entries. A longer notice is stored as 'truncated' (its
-- pairs are still published in full); replaying it means reconciling instead.
local STREAM_PAIRS_MAX_BYTES = 1024

-- Whole numbers as decimal text without exponent (Lua would print 1.7e+15).
local function digits(number)
  return string.format('%.0f', number)
end

-- Three decimal digits taken from the request id (hex): the random part of new ids.
local function nonce()
  local n = tonumber(string.sub(ARGV[2], 1, 6), 16) or 0
  return string.format('%03d', n % 1000)
end

-- The server's clock: microseconds as 16 digits of text, and milliseconds as a number.
local function now_us_text()
  local time = redis.call('TIME')
  return time[1] .. string.format('%06d', tonumber(time[2]))
end

local function now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- A new owner epoch for the namespace: the server's clock in microseconds plus three
-- random digits, never a counter that a lost meta would restart; nudged if it equals the
-- current one (two claims in one microsecond with the same random digits).
local function new_epoch(meta_key)
  local epoch = now_us_text() .. nonce()
  if epoch == redis.call('HGET', meta_key, 'epoch') then
    epoch = string.sub(epoch, 1, -2) .. ((tonumber(string.sub(epoch, -1)) + 1) % 10)
  end
  return epoch
end

-- Owner fencing. Returns an error reply when `epoch` is set and is not the namespace's
-- current epoch (in meta; a lost meta matches no epoch, since epochs never repeat).
local function stale_epoch(meta_key, epoch)
  if epoch == '' then
    return nil
  end
  local current = redis.call('HGET', meta_key, 'epoch')
  if current == epoch then
    return nil
  end
  return redis.error_reply('STALE_EPOCH namespace epoch is ' .. (current or 'unset')
    .. ', this owner holds ' .. epoch)
end

-- Exclusive ownership of a mirrored namespace (registry/mirror.py). A mirrored owner's
-- claim records its epoch as meta's `mirror_epoch` and its label as `mirror_owner`:
-- while that epoch is the current one and its lease is live, a write carrying any other
-- epoch ('' included: an operator) is refused, so the owner's local mirror can never
-- silently diverge from Redis. Namespaces never claimed by a mirror have no such field
-- and pay one HGET.
local function mirrored(meta_key, epoch)
  local owner_epoch = redis.call('HGET', meta_key, 'mirror_epoch')
  if not owner_epoch or owner_epoch == epoch then
    return nil
  end
  local fields = redis.call('HMGET', meta_key, 'epoch', 'lease_until', 'mirror_owner')
  if fields[1] ~= owner_epoch or tonumber(fields[2] or '0') <= now_ms() then
    return nil  -- superseded by a claim, or the mirrored owner's lease ran out
  end
  return redis.error_reply('NAMESPACE_MIRRORED ' .. (fields[3] or '?')
    .. ' owns this namespace through a write-behind mirror (epoch ' .. owner_epoch
    .. ', lease live): only it may write here')
end

-- Start of every write: the recorded reply of this request id (a retried copy), or the
-- STALE_EPOCH error, or the NAMESPACE_MIRRORED error, or nil to go on. A claim passes
-- `claiming`: taking a namespace over (fencing its mirrored owner) stays allowed.
local function begin_write(meta_key, claiming)
  local saved = redis.call('GET', KEYS[1])
  if saved then
    return cjson.decode(saved)
  end
  local stale = stale_epoch(meta_key, ARGV[1])
  if stale or claiming then
    return stale
  end
  return mirrored(meta_key, ARGV[1])
end

-- End of every write: record the reply under the request id for ARGV[3] ms; return it.
local function finish_write(reply)
  redis.call('SET', KEYS[1], cjson.encode(reply), 'PX', ARGV[3])
  return reply
end

-- The namespace's history: its incarnation id, created (with notice numbers starting
-- at the server's clock in microseconds) whenever meta has none, i.e. the first write
-- ever, or after meta was lost (gc, a server that restarted empty, an eviction). So
-- notice numbers never go back, and a listener that sees a new incarnation reconciles.
local function history(meta_key)
  local incarnation = redis.call('HGET', meta_key, 'incarnation')
  if incarnation then
    return incarnation
  end
  local base = now_us_text()
  incarnation = base .. nonce()
  redis.call('HSET', meta_key, 'incarnation', incarnation, 'notice_seq', base, 'schema', '2')
  return incarnation
end

-- Remove the fields list[from..to] (distinct hashes) from the HASH `key`.
-- Appends each removed hash to `removed_hashes`, and "block_id:hash" to `pair_texts`
-- when that table is given (the block id is the field's old value). Returns the count.
local function remove_fields(key, list, from, to, removed_hashes, pair_texts)
  local count = #removed_hashes
  for first = from, to, CHUNK do
    local last = math.min(first + CHUNK - 1, to)
    local ids = redis.call('HMGET', key, unpack(list, first, last))
    local start = count
    for i = 1, last - first + 1 do
      local id = ids[i]
      if id then
        local hash = list[first + i - 1]
        count = count + 1
        removed_hashes[count] = hash
        if pair_texts then
          pair_texts[count] = id .. ':' .. hash
        end
      end
    end
    if count > start then
      redis.call('HDEL', key, unpack(removed_hashes, start + 1, count))
    end
  end
  return count
end

-- Number one eviction notice, append it to the capped stream and publish it.
-- kind: 'evict' | 'cascade' | 'replace' | 'clear'; pairs_text: "bid:hash bid:hash ..." or ''.
-- Channel message: "<seq>@<incarnation> <kind> @<published ms>[ <bid>:<hash> ...]" (the
-- server's clock when published: listeners measure publish-to-free from it). Returns that
-- message, which is also what the calling script replies with: the caller parses it.
local function publish_notice(meta_key, stream_key, channel, stream_maxlen, kind, pairs_text)
  local incarnation = history(meta_key)
  local seq = digits(redis.call('HINCRBY', meta_key, 'notice_seq', 1))
  local published = digits(now_ms())
  local kept, truncated = pairs_text, '0'
  if #pairs_text > STREAM_PAIRS_MAX_BYTES then
    kept, truncated = '', '1'
  end
  redis.call('XADD', stream_key, 'MAXLEN', '~', stream_maxlen, '*',
    'seq', seq, 'inc', incarnation, 'kind', kind, 'pairs', kept, 'truncated', truncated,
    't', published)
  local message = seq .. '@' .. incarnation .. ' ' .. kind .. ' @' .. published
  if pairs_text ~= '' then
    message = message .. ' ' .. pairs_text
  end
  redis.call('PUBLISH', channel, message)
  return message
end

-- Whether a name read from a shared key can be a namespace: 1 to 800 bytes of
-- well-formed UTF-8 without '{', '}', ASCII whitespace or control characters. Anyone
-- allowed to write the node index can write garbage; one bad member must not break
-- routing for the fleet (the client applies the full rules).
local function well_formed(name)
  local n = #name
  if n == 0 or n > 800 or string.find(name, '[{}%s%c]') then
    return false
  end
  local i = 1
  while i <= n do
    local c = string.byte(name, i)
    local extra, low, high = 0, 0x80, 0xBF
    if c < 0x80 then
      extra = 0
    elseif c >= 0xC2 and c <= 0xDF then
      extra = 1
    elseif c >= 0xE0 and c <= 0xEF then
      extra = 2
      if c == 0xE0 then low = 0xA0 elseif c == 0xED then high = 0x9F end
    elseif c >= 0xF0 and c <= 0xF4 then
      extra = 3
      if c == 0xF0 then low = 0x90 elseif c == 0xF4 then high = 0x8F end
    else
      return false
    end
    for j = i + 1, i + extra do
      local d = string.byte(name, j)
      if not d or d < low or d > high then
        return false
      end
      low, high = 0x80, 0xBF
    end
    i = i + extra + 1
  end
  return true
end

-- A namespace that ever held Mamba state in its history (since its owner's claim) is a
-- hybrid model's node: routers rank it by its Mamba-aware prefix (lua/score.lua), the
-- others by their KV prefix. Meta's `mamba_seen` says so; set with the first entry.
local function mamba_seen(meta_key)
  redis.call('HSET', meta_key, 'mamba_seen', '1')
end

-- Set the hash -> block id pairs ARGV[first..last] in the Mamba map `key` (in chunks of
-- CHUNK arguments, an even number: pairs stay whole); returns "<old id>:<hash>" for each
-- hash that moved to another block id (register_mamba's 'replace' notice). Marks the
-- namespace's `meta_key` (mamba_seen).
local function set_mamba_pairs(key, meta_key, first, last)
  if last >= first then
    mamba_seen(meta_key)
  end
  local moved = {}
  for from = first, last, CHUNK do
    local to = math.min(from + CHUNK - 1, last)
    local fields = {}
    for i = from, to, 2 do
      fields[#fields + 1] = ARGV[i]
    end
    local old_ids = redis.call('HMGET', key, unpack(fields))
    for j = 1, #fields do
      local old_id = old_ids[j]
      if old_id and old_id ~= ARGV[from + 2 * j - 1] then
        moved[#moved + 1] = old_id .. ':' .. fields[j]
      end
    end
    redis.call('HSET', key, unpack(ARGV, from, to))
  end
  return moved
end

-- Change records (registry/fleet/view.py): every write that changed a namespace's maps
-- publishes one record of what it changed, in this script, on the namespace's channel
-- "pcr:{node-0}:changes" (inside a node user's ACL channel pattern, and no namespace
-- can publish another's), which every router's in-process view follows by pattern:
--   "<namespace> <incarnation> <seq> <part> <part> ..."
-- numbered by meta's `change_seq` (1, 2, ... within the incarnation: a view that sees a
-- number skipped, or a new incarnation, reloads the namespace), each part an operation
-- letter pair followed by its hashes: 'k+' KV entries set, 'k-' KV entries removed,
-- 'm+' Mamba entries set (the namespace is a hybrid model's node), 'm-' Mamba entries
-- removed; or one letter alone: 'K' the KV map emptied, 'M' the Mamba map emptied, 'C'
-- claimed (both emptied, no longer known as hybrid), 'L' load the namespace again from
-- its maps, 'G' the namespace collected. A fenced or refused write returns before it and
-- publishes nothing. The channel and the namespace come from the meta key in KEYS
-- (neither the key prefix nor a namespace may contain '{' or '}'); a channel is not a key.
-- `parts` is a list of strings; `record_changes` does nothing for an empty list.
-- Calls:   HGET (history), HINCRBY, PUBLISH
local function publish_change(meta_key, incarnation, seq, text)
  local base = string.sub(meta_key, 1, -6)  -- "pcr:{node-0}" of "pcr:{node-0}:meta"
  local namespace = string.match(base, '{(.*)}$')
  redis.call('PUBLISH', base .. ':changes',
    namespace .. ' ' .. incarnation .. ' ' .. seq .. ' ' .. text)
end

local function record_changes(meta_key, parts)
  if #parts == 0 then
    return
  end
  local incarnation = history(meta_key)
  local seq = digits(redis.call('HINCRBY', meta_key, 'change_seq', 1))
  publish_change(meta_key, incarnation, seq, table.concat(parts, ' '))
end

-- The record 'G' of a namespace about to be collected (its meta deleted): numbered
-- after its last record; nothing for a namespace that has no history.
local function record_gone(meta_key)
  local fields = redis.call('HMGET', meta_key, 'incarnation', 'change_seq')
  if fields[1] then
    publish_change(meta_key, fields[1], digits((tonumber(fields[2]) or 0) + 1), 'G')
  end
end

-- Append the operation `op` and the values list[from..to] to `parts`, when there is at
-- least one value (with `step` 2: every other value, the hashes of hash, id pairs).
local function add_part(parts, op, list, from, to, step)
  if to < from then
    return
  end
  local n = #parts
  n = n + 1
  parts[n] = op
  for i = from, to, step or 1 do
    n = n + 1
    parts[n] = list[i]
  end
end

-- Entry quotas (docs/guides/security.md, "Entry quotas"). An admin may cap how many KV
-- plus Mamba entries a namespace holds: the STRING "pcr:quota:{node-0}" (the namespace's
-- hash tag, so the same cluster slot as its other keys) holds the limit, a whole number
-- (`pcr quota set`). It lies outside the node users' key pattern "pcr:{node-0}:*": their
-- ACL (docs/acl/node.acl) lets the scripts read it and no command of theirs write it.
-- Every script that adds entries checks it before writing anything, so a refused write
-- changes nothing; removals are never refused.
-- Returns: the limit, or nil when none is set; nil and an error reply (QUOTA_INVALID)
--          when the key holds something that is not a whole number.
local function entry_limit(quota_key)
  local value = redis.call('GET', quota_key)
  if not value then
    return nil
  end
  if not string.match(value, '^%d+$') or #value > 16 then
    return nil, redis.error_reply('QUOTA_INVALID ' .. quota_key
      .. ' does not hold a whole number of entries: set it again with pcr quota set')
  end
  return tonumber(value)
end

-- The KV plus Mamba entries a namespace holds now.
local function entry_count(kv_key, mamba_key)
  return redis.call('HLEN', kv_key) + redis.call('HLEN', mamba_key)
end

-- The QUOTA refusal of a write that would take a namespace from `before` to `after`
-- `what` ('entries'; 'engine blocks' for a bridged namespace's engine-blocks) past its
-- `limit`, or nil. A write that leaves no more than the namespace held (a removal, a
-- rewrite of entries it holds, a namespace over a lowered limit that shrinks) passes.
-- The namespace is the hash tag of `meta_key`.
local function over_quota(meta_key, limit, before, after, what)
  if not limit or after <= limit or after <= before then
    return nil
  end
  return redis.error_reply('QUOTA namespace ' .. string.match(meta_key, '{(.*)}') .. ' holds '
    .. digits(before) .. ' ' .. what .. ', limit ' .. digits(limit)
    .. ': this write would make it ' .. digits(after) .. '; nothing was applied')
end

-- How many of the fields list[first], list[first + step], ... (up to list[last]; distinct)
-- the HASH `key` lacks: the entries a registration of them adds.
local function missing_fields(key, list, first, last, step)
  local missing = 0
  local span = CHUNK * step
  for from = first, last, span do
    local fields = {}
    for i = from, math.min(from + span - 1, last), step do
      fields[#fields + 1] = list[i]
    end
    local values = redis.call('HMGET', key, unpack(fields))
    for j = 1, #fields do
      if not values[j] then
        missing = missing + 1
      end
    end
  end
  return missing
end

-- The QUOTA refusal (or QUOTA_INVALID) of registering the hash, block id pairs
-- ARGV[first..last] (distinct hashes) in `map_key`, one of the namespace's maps
-- `kv_key` and `mamba_key`, or nil. The exact count of new hashes is read only when
-- adding every pair could pass the limit.
local function registration_refused(quota_key, meta_key, kv_key, mamba_key, map_key, first, last)
  local limit, invalid = entry_limit(quota_key)
  if not limit then
    return invalid
  end
  local before = entry_count(kv_key, mamba_key)
  local after = before + (last - first + 1) / 2
  if after > limit then
    after = before + missing_fields(map_key, ARGV, first, last, 2)
  end
  return over_quota(meta_key, limit, before, after, 'entries')
end
