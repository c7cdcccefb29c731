-- fleet_snapshot: one namespace as a router's in-process fleet view loads it
-- (registry/fleet/view.py): the hashes in its two maps and the number of the last change
-- record they include, read in one step, so the view applies exactly the records after
-- it. Read-only.
--
-- KEYS[1]  pcr:{node-0}:kv       HASH hash -> KV block id
-- KEYS[2]  pcr:{node-0}:mamba    HASH hash -> block id with Mamba state
-- KEYS[3]  pcr:{node-0}:meta     HASH incarnation, change_seq, mamba_seen
--
-- Returns: { incarnation ('' when the namespace has no history: nothing to hold),
--            change_seq ('0' before the first record), mamba_seen ('1' or ''),
--            the KV map's hashes joined by spaces, the Mamba map's hashes joined by spaces }
-- Calls:   HMGET, HKEYS
local meta = redis.call('HMGET', KEYS[3], 'incarnation', 'change_seq', 'mamba_seen')
if not meta[1] then
  return {'', '0', '', '', ''}
end
return {meta[1], meta[2] or '0', meta[3] or '',
  table.concat(redis.call('HKEYS', KEYS[1]), ' '), table.concat(redis.call('HKEYS', KEYS[2]), ' ')}
