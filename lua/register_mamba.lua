-- register_mamba: add (hash -> block id) entries for blocks that hold a Mamba state
-- checkpoint. A hash that already pointed at another block id loses that old entry:
-- it is announced with a 'replace' notice so the owner of the old slot frees it.
--
-- KEYS[1]  pcr:{node-0}:mamba              HASH hash -> block id with Mamba state
-- KEYS[2]  pcr:{node-0}:meta               HASH schema, epoch, notice_seq
-- KEYS[3]  pcr:{node-0}:mamba-evictions    STREAM of notices, capped
-- ARGV[1]  "3" or ""                       the caller's owner epoch ('' = not an owner)
-- ARGV[2]  pcr:{node-0}:mamba-evicted      channel for the notice
-- ARGV[3]  "10000"                         approximate stream cap (MAXLEN ~)
-- ARGV[4..] hash1, block_id1, hash2, block_id2, ...; hashes > 0, distinct (caller checks)
--
-- Returns: { notice, stamp }: notice is "" or the text of the 'replace' notice listing
--          the (old block id, hash) entries that were replaced; stamp is
--          the namespace's notice number after this call; only a notice numbered above
--          it can remove the entries just written (block ids are reused, so a slot
--          owner needs this to ignore late notices about an older registration);
--          error STALE_EPOCH when the caller's epoch was superseded.
-- Calls:   HGET, HMGET, HSET, HINCRBY, XADD, PUBLISH
local stale = stale_epoch(KEYS[2], ARGV[1])
if stale then return stale end
local pair_texts = {}
local n = #ARGV
for first = 4, n, CHUNK do
  local last = math.min(first + CHUNK - 1, n)
  local fields = {}
  for i = first, last, 2 do
    fields[#fields + 1] = ARGV[i]
  end
  local old_ids = redis.call('HMGET', KEYS[1], unpack(fields))
  for j = 1, #fields do
    local old_id = old_ids[j]
    if old_id and old_id ~= ARGV[first + 2 * j - 1] then
      pair_texts[#pair_texts + 1] = old_id .. ':' .. fields[j]
    end
  end
  redis.call('HSET', KEYS[1], unpack(ARGV, first, last))
end
local notice = ''
if #pair_texts > 0 then
  notice = publish_notice(KEYS[2], KEYS[3], ARGV[2], ARGV[3], 'replace', table.concat(pair_texts, ' '))
end
return {notice, tonumber(redis.call('HGET', KEYS[2], 'notice_seq') or '0')}
