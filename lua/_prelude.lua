-- _prelude.lua: shared by every script; registry/scripts.py puts it in front of each
-- script body before loading, so one SCRIPT LOAD still carries one self-contained script.
--
-- Rules every script follows (see DESIGN.md):
--   * a block hash stays a string from ARGV to reply; Lua numbers are doubles and
--     would round hashes above 2^53, so `tonumber` is never applied to a hash;
--   * `unpack` is chunked (CHUNK values at a time): Lua's C stack holds about 8,000;
--   * every key comes from KEYS; the channel name is not a key and comes from ARGV;
--   * a write script's ARGV[1] is the caller's owner epoch ('' for a caller that owns
--     nothing, such as an operator); a superseded owner's write changes nothing.

local CHUNK = 4000

-- Owner fencing. Returns an error reply when `epoch` is set and is not the namespace's
-- current epoch (in meta), so the caller returns it before writing anything.
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

-- The server's clock in milliseconds (leases use it, so client clocks never matter).
local function now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
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
-- Channel message: "<seq> <kind>[ <bid>:<hash> ...]". Returns that message, which is
-- also what the calling script replies with: the caller parses the notice it made.
local function publish_notice(meta_key, stream_key, channel, stream_maxlen, kind, pairs_text)
  local seq = redis.call('HINCRBY', meta_key, 'notice_seq', 1)
  redis.call('HSETNX', meta_key, 'schema', '1')
  redis.call('XADD', stream_key, 'MAXLEN', '~', stream_maxlen, '*',
    'seq', seq, 'kind', kind, 'pairs', pairs_text)
  local message = seq .. ' ' .. kind
  if pairs_text ~= '' then
    message = message .. ' ' .. pairs_text
  end
  redis.call('PUBLISH', channel, message)
  return message
end
