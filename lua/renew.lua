-- renew: extend the owner's lease (heartbeat). Fenced: a superseded owner, or one whose
-- namespace was garbage-collected or lost, gets STALE_EPOCH.
--
-- KEYS[1]  pcr:{node-0}:reply:5f1c2a9b03e1-7   this request's reply record
-- KEYS[2]  pcr:{node-0}:meta                    HASH epoch, lease_until
-- ARGV[1]  "1796024288853123482"                the owner's epoch
-- ARGV[2]  "5f1c2a9b03e1-7"                     request id
-- ARGV[3]  "30000"                              how long the reply is kept (ms)
-- ARGV[4]  "10000"                              lease length in milliseconds
--
-- Returns: the new lease end (server clock, ms) as text; error STALE_EPOCH.
-- Calls:   GET, HGET, TIME, HDEL, HSET, SET
local early = begin_write(KEYS[2])
if early then return early end
local lease_until = digits(now_ms() + tonumber(ARGV[4]))
-- HDEL first: Redis refuses a script under maxmemory only at its first write, and HDEL
-- never adds memory, so a node keeps its lease while an operator frees memory.
redis.call('HDEL', KEYS[2], 'lease_until')
redis.call('HSET', KEYS[2], 'lease_until', lease_until)
return finish_write(lease_until)
