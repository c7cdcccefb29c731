-- gc_namespace: delete every key of a namespace whose lease has run out. The lease is
-- re-checked here, atomically with the delete, so a node that renewed after gc listed
-- it as dead keeps its keys.
--
-- KEYS[1..5]  pcr:{node-0}:kv, :mamba, :meta, :mamba-evictions, :engine-blocks
--
-- Returns: integer, 1 if deleted, 0 if the lease is live again.
-- Calls:   TIME, HGET, HMGET, PUBLISH (the change record G), UNLINK
local lease_until = redis.call('HGET', KEYS[3], 'lease_until')
if lease_until and tonumber(lease_until) > now_ms() then
  return 0
end
record_gone(KEYS[3])
redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return 1
