-- register_mamba: add (hash -> block id) entries for blocks that hold a Mamba state
-- checkpoint. A hash that already pointed at another block id loses that old entry:
-- it is announced with a 'replace' notice so the owner of the old slot frees it.
--
-- KEYS[1]  pcr:{node-0}:reply:5f1c2a9b03e1-7   this request's reply record
-- KEYS[2]  pcr:{node-0}:mamba                   HASH hash -> block id with Mamba state
-- KEYS[3]  pcr:{node-0}:meta                    HASH epoch, incarnation, notice_seq
-- KEYS[4]  pcr:{node-0}:mamba-evictions         STREAM of notices, capped
-- KEYS[5]  pcr:{node-0}:kv                      HASH hash -> KV block id (counted for the quota)
-- KEYS[6]  pcr:quota:{node-0}                   STRING the namespace's entry limit, if any
-- ARGV[1]  "1796024288853123482" or ""          the caller's owner epoch ('' = not an owner)
-- ARGV[2]  "5f1c2a9b03e1-7"                     request id
-- ARGV[3]  "30000"                              how long the reply is kept (ms)
-- ARGV[4]  pcr:{node-0}:mamba-evicted           channel for the notice
-- ARGV[5]  "1000"                               approximate stream cap (MAXLEN ~)
-- ARGV[6..] hash1, block_id1, hash2, block_id2, ...; hashes > 0, distinct (caller checks)
--
-- Returns: { notice, stamp }: notice is "" or the text of the 'replace' notice listing
--          the (old block id, hash) entries that were replaced; stamp is the
--          namespace's notice number after this call, as text; only a notice numbered
--          above it can remove the entries just written (block ids are reused, so a
--          slot owner needs this to ignore late notices about an older registration);
--          a retried request returns the first copy's reply;
--          error STALE_EPOCH when the caller's epoch was superseded or its namespace lost;
--          error QUOTA (nothing applied) when the new hashes would take the namespace's
--          KV plus Mamba entries past its limit (KEYS[6]).
-- Calls:   GET, HGET, HMGET, HSET, HINCRBY, TIME, XADD, PUBLISH, SET; with a limit set, HLEN
--          (HSET also marks meta's mamba_seen: a hybrid model's node, lua/score.lua)
local early = begin_write(KEYS[3])
if early then return early end
local refused = registration_refused(KEYS[6], KEYS[3], KEYS[5], KEYS[2], KEYS[2], 6, #ARGV)
if refused then return refused end
history(KEYS[3])  -- stamps count in the current history's numbers
local pair_texts = set_mamba_pairs(KEYS[2], KEYS[3], 6, #ARGV)
local notice = ''
local parts = {}
add_part(parts, 'm+', ARGV, 6, #ARGV, 2)
record_changes(KEYS[3], parts)
if #pair_texts > 0 then
  notice = publish_notice(KEYS[3], KEYS[4], ARGV[4], ARGV[5], 'replace',
    table.concat(pair_texts, ' '))
end
return finish_write({notice, redis.call('HGET', KEYS[3], 'notice_seq')})
