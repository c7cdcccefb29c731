-- notice_sequence: the number of the namespace's last eviction notice (0 if none yet).
--
-- KEYS[1]  pcr:{node-0}:meta    HASH schema, notice_seq
--
-- Returns: integer.
-- Calls:   HGET
return tonumber(redis.call('HGET', KEYS[1], 'notice_seq') or '0')
