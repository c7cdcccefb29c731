-- renew: extend the owner's lease (heartbeat). Fenced: a superseded owner, or one whose
-- namespace was garbage-collected after its lease ran out, gets STALE_EPOCH.
--
-- KEYS[1]  pcr:{node-0}:meta    HASH epoch, lease_until
-- ARGV[1]  "3"                  the owner's epoch
-- ARGV[2]  "10000"              lease length in milliseconds
--
-- Returns: integer, the new lease end (server clock, ms); error STALE_EPOCH.
-- Calls:   HGET, TIME, HSET
local stale = stale_epoch(KEYS[1], ARGV[1])
if stale then return stale end
local lease_until = now_ms() + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'lease_until', lease_until)
return lease_until
