-- clear_kv: drop every KV entry of the namespace (Mamba entries stay, as in the seed).
--
-- KEYS[1]  pcr:{node-0}:kv    HASH hash -> KV block id
--
-- Returns: integer, 1 if there was anything to drop, else 0.
-- Calls:   UNLINK (the hash is freed off the main thread)
return redis.call('UNLINK', KEYS[1])
