-- index_update: add or drop one member's bits in the fleet index, the derived view
-- routers score from: per block hash, which live namespaces hold it (registry/fleet.py;
-- the layout and the edit are `index_change` in _prelude.lua). An owner's write makes
-- the same change inside its own script when the shard is on its node; this script is
-- the upkeep of the others (shard elsewhere, two ids during a rebuild), of rebuilds, of
-- the bridge and of a mirror's batches.
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
-- shard refused the change (the others applied it): the writer rebuilds its bits; the
-- error a shard command answered (NOPERM, WRONGTYPE, ...), at the first such shard.
-- Calls:   HGET, HMGET, HSET, HDEL
local epoch = ARGV[3]
if ARGV[2] == 'stamp' then
  local stamp_field = '@' .. ARGV[1]
  for k = 1, #KEYS do
    redis.call('HSET', KEYS[k], stamp_field, epoch)
  end
  return #KEYS
end
if not INDEX_DIGITS[ARGV[2]] then
  return redis.error_reply('BAD_CHANGE index_update: unknown change ' .. tostring(ARGV[2]))
end
local count, refused = 0, 0
local at = 4
for k = 1, #KEYS do
  local n = tonumber(ARGV[at])
  local changed, err = index_change(KEYS[k], ARGV[1], ARGV[2], epoch, ARGV, at + 1, at + n)
  if changed == -2 then
    return redis.error_reply(err)  -- as the command itself answered (NOPERM, WRONGTYPE, ...)
  elseif changed < 0 then
    refused = refused + 1
  else
    count = count + changed
  end
  at = at + n + 1
end
if refused > 0 then
  return redis.error_reply('STALE_MEMBER index_update: member ' .. ARGV[1]
    .. ' is not stamped with epoch "' .. epoch .. '" on ' .. refused .. ' of '
    .. #KEYS .. ' shards (superseded, or the stamp was lost)')
end
return count
