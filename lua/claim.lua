-- claim: a (re)starting owner takes a new epoch for its namespace. In the same step it
-- drops the previous incarnation's entries (its GPU blocks are gone), announces that
-- with a 'clear' notice (always: the caller's own slot pool hears it in-process), and
-- starts a lease. Epochs never repeat: the server's clock in microseconds plus three
-- random digits, never stored as a counter that a lost meta would restart; so a late
-- write from any earlier owner fails with STALE_EPOCH and resurrects nothing.
--
-- KEYS[1]  pcr:{node-0}:reply:5f1c2a9b03e1-7   this request's reply record
-- KEYS[2]  pcr:{node-0}:kv                      HASH hash -> KV block id
-- KEYS[3]  pcr:{node-0}:mamba                   HASH hash -> block id with Mamba state
-- KEYS[4]  pcr:{node-0}:meta                    HASH schema, epoch, incarnation,
--                                                    notice_seq, lease_until
-- KEYS[5]  pcr:{node-0}:mamba-evictions         STREAM of notices, capped
-- KEYS[6]  pcr:{node-0}:engine-blocks           HASH of a bridged namespace (dropped too)
-- ARGV[1]  ""                                   (claims are never fenced)
-- ARGV[2]  "5f1c2a9b03e1-7"                     request id (its first hex digits give
--                                                the epoch's random part)
-- ARGV[3]  "30000"                              how long the reply is kept (ms)
-- ARGV[4]  pcr:{node-0}:mamba-evicted           channel for the 'clear' notice
-- ARGV[5]  "1000"                               approximate stream cap (MAXLEN ~)
-- ARGV[6]  "10000"                              lease length in milliseconds
-- ARGV[7]  "node-0 (host:pid)" or ""            a mirrored owner's label (registry/mirror.py):
--                                                while its lease is live, writes with any
--                                                other epoch are refused (NAMESPACE_MIRRORED);
--                                                "" or absent: an ordinary owner
--
-- Returns: { new epoch, lease end (server clock, ms), clear notice }, numbers as text.
-- Calls:   GET, TIME, HGET, HSET, UNLINK, HDEL, HINCRBY, XADD, PUBLISH, SET
local early = begin_write(KEYS[4], true)  -- a claim fences even a mirrored owner
if early then return early end
local epoch = new_epoch(KEYS[4])
-- The first write adds data, so a server out of memory (noeviction) refuses the whole
-- claim here, before anything changed (Redis checks only a script's first write).
local lease_until = digits(now_ms() + tonumber(ARGV[6]))
redis.call('HSET', KEYS[4], 'epoch', epoch, 'lease_until', lease_until)
redis.call('UNLINK', KEYS[2], KEYS[3], KEYS[6])
-- A new owner starts a new history: it is not following an engine until it says so.
redis.call('HDEL', KEYS[4], 'bridge_seq', 'bridge_engine', 'bridge_endpoint', 'bridge_block_size',
  'mamba_seen')
if ARGV[7] and ARGV[7] ~= '' then
  redis.call('HSET', KEYS[4], 'mirror_epoch', epoch, 'mirror_owner', ARGV[7])
else
  redis.call('HDEL', KEYS[4], 'mirror_epoch', 'mirror_owner')
end
local notice = publish_notice(KEYS[4], KEYS[5], ARGV[4], ARGV[5], 'clear', '')
record_changes(KEYS[4], {'C'})
return finish_write({epoch, lease_until, notice})
