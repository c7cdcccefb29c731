-- bridge_apply: apply one or more engine event batches (decoded and hashed by
-- `pcr bridge`) to a bridged namespace, atomically and in order, and record the last
-- engine sequence number applied. Idempotent: applying the same batch twice leaves the
-- same state, so a batch whose outcome is unknown may be sent again.
--
-- Each engine block is held by some (group, medium) slots of the engine; the holders
-- are one character per slot in `engine-blocks` ('0' not held, 'k' held by an
-- attention group, 'm' held by a Mamba group). The KV map lists a block while any
-- attention slot holds it; the Mamba map while a Mamba slot holds it and the KV map
-- lists it (Mamba state is usable only with its KV prefix). The block id stored is the
-- block's position in its prefix (0 for the first block).
--
-- KEYS[1]  pcr:{node-0}:reply:5f1c2a9b03e1-7   this request's reply record
-- KEYS[2]  pcr:{node-0}:kv                      HASH own hash -> block id
-- KEYS[3]  pcr:{node-0}:mamba                   HASH own hash -> block id
-- KEYS[4]  pcr:{node-0}:meta                    HASH epoch, bridge_* fields
-- KEYS[5]  pcr:{node-0}:engine-blocks           HASH engine hash ->
--                                                    "<own> <block id> <digest> <holders>"
-- ARGV[1]  "1796024288853123482"                the bridge's owner epoch
-- ARGV[2]  "5f1c2a9b03e1-7"                     request id
-- ARGV[3]  "30000"                              how long the reply is kept (ms)
-- ARGV[4]  "1041"                               last engine seq of these batches, or ""
-- ARGV[5]  "vllm"                               engine kind      (meta bridge_engine)
-- ARGV[6]  "tcp://10.0.0.7:5557"                engine endpoint  (meta bridge_endpoint)
-- ARGV[7]  "16"                                 block size, or "" (meta bridge_block_size)
-- ARGV[8..] operations, in order:
--   "S", engine hash, slot, 'k'|'m', own hash, block id, digest hex   a block stored
--   "R", engine hash, slot                                            a block removed
--   "C"                                                               all cleared
--   (slot: 1..64, the holder character of the event's (group, medium))
--
-- Returns: { blocks stored, blocks removed, removals of unknown blocks, clears }
-- Calls:   GET, HGET, HSET, HDEL, UNLINK, SET
local early = begin_write(KEYS[4])
if early then return early end
local meta = {'bridge_engine', ARGV[5], 'bridge_endpoint', ARGV[6]}
if ARGV[4] ~= '' then
  meta[#meta + 1] = 'bridge_seq'
  meta[#meta + 1] = ARGV[4]
end
if ARGV[7] ~= '' then
  meta[#meta + 1] = 'bridge_block_size'
  meta[#meta + 1] = ARGV[7]
end
redis.call('HSET', KEYS[4], unpack(meta))

local kv, mamba, blocks = KEYS[2], KEYS[3], KEYS[5]
local stored, removed, unknown, cleared = 0, 0, 0, 0

-- Which maps list a block with these holders: kv, mamba.
local function listed(holders)
  local k = string.find(holders, 'k', 1, true) ~= nil
  return k, k and string.find(holders, 'm', 1, true) ~= nil
end

local i, n = 8, #ARGV
while i <= n do
  local op = ARGV[i]
  if op == 'S' then
    local engine, slot, kind = ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3]
    local own, block_id, digest = ARGV[i + 4], ARGV[i + 5], ARGV[i + 6]
    local old = redis.call('HGET', blocks, engine)
    local holders = ''
    if old then
      holders = string.match(old, '^%S+ %S+ %S+ (%S*)$') or ''
    end
    local had_k, had_m = listed(holders)
    if #holders < slot then
      holders = holders .. string.rep('0', slot - #holders)
    end
    holders = string.sub(holders, 1, slot - 1) .. kind .. string.sub(holders, slot + 1)
    redis.call('HSET', blocks, engine, own .. ' ' .. block_id .. ' ' .. digest .. ' ' .. holders)
    local has_k, has_m = listed(holders)
    if has_k then
      redis.call('HSET', kv, own, block_id)
    end
    if has_m then
      redis.call('HSET', mamba, own, block_id)
    end
    if has_k and not had_k then
      stored = stored + 1
    end
    i = i + 7
  elseif op == 'R' then
    local engine, slot = ARGV[i + 1], tonumber(ARGV[i + 2])
    local old = redis.call('HGET', blocks, engine)
    local own, block_id, digest, holders
    if old then
      own, block_id, digest, holders = string.match(old, '^(%S+) (%S+) (%S+) (%S*)$')
    end
    if not own or #holders < slot or string.sub(holders, slot, slot) == '0' then
      unknown = unknown + 1
    else
      local had_k, had_m = listed(holders)
      holders = string.sub(holders, 1, slot - 1) .. '0' .. string.sub(holders, slot + 1)
      local has_k, has_m = listed(holders)
      if string.find(holders, '[km]') then
        redis.call('HSET', blocks, engine, own .. ' ' .. block_id .. ' ' .. digest .. ' ' .. holders)
      else
        redis.call('HDEL', blocks, engine)
      end
      if had_k and not has_k then
        redis.call('HDEL', kv, own)
        removed = removed + 1
      end
      if had_m and not has_m then
        redis.call('HDEL', mamba, own)
      end
    end
    i = i + 3
  elseif op == 'C' then
    redis.call('UNLINK', kv, mamba, blocks)
    cleared = cleared + 1
    i = i + 1
  else
    return redis.error_reply('BAD_OPERATION bridge_apply: unknown operation ' .. tostring(op))
  end
end
return finish_write({stored, removed, unknown, cleared})
