-- clear_kv: drop every KV entry of the namespace (Mamba entries stay, as in Megatron-Core).
--
-- KEYS[1]  pcr:{node-0}:reply:5f1c2a9b03e1-7   this request's reply record
-- KEYS[2]  pcr:{node-0}:kv                      HASH hash -> KV block id
-- KEYS[3]  pcr:{node-0}:meta                    HASH epoch
-- ARGV[1]  "1796024288853123482" or ""          the caller's owner epoch ('' = not an owner)
-- ARGV[2]  "5f1c2a9b03e1-7"                     request id
-- ARGV[3]  "30000"                              how long the reply is kept (ms)
--
-- Returns: integer, 1 if there was anything to drop, else 0 (a retry: the first
--          copy's reply); error STALE_EPOCH when the caller's epoch was superseded.
-- Calls:   GET, HGET, UNLINK (the hash is freed off the main thread), HSET, HINCRBY, TIME,
--          PUBLISH (the change record), SET
local early = begin_write(KEYS[3])
if early then return early end
local removed = redis.call('UNLINK', KEYS[2])
if removed > 0 then
  record_changes(KEYS[3], {'K'})
end
return finish_write(removed)
