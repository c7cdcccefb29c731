-- clear_kv: drop every KV entry of the namespace (Mamba entries stay, as in the seed).
--
-- KEYS[1]  pcr:{node-0}:kv      HASH hash -> KV block id
-- KEYS[2]  pcr:{node-0}:meta    HASH epoch
-- ARGV[1]  "3" or ""            the caller's owner epoch ('' = not an owner)
--
-- Returns: integer, 1 if there was anything to drop, else 0;
--          error STALE_EPOCH when the caller's epoch was superseded.
-- Calls:   HGET, UNLINK (the hash is freed off the main thread)
local stale = stale_epoch(KEYS[2], ARGV[1])
if stale then return stale end
return redis.call('UNLINK', KEYS[1])
