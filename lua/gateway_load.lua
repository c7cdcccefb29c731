-- gateway_load: one gateway replica publishes what it sends each backend now (requests in
-- flight, their prefill tokens, a decayed count of the prefill tokens it sent lately) and
-- reads what the other replicas published, so replicas balance like one gateway. Each
-- replica's entry expires by the server's clock: a replica that stops publishing (killed,
-- partitioned) drops out within its TTL; expired entries are removed here. The entry also
-- goes out on a channel, so that the other replicas see it as it changes (a replica runs
-- this when a request starts or ends, and every 100 ms besides).
--
-- KEYS[1]  pcr:gateway:load   HASH replica id -> "<expires ms> <payload>"
-- ARGV[1]  "gw-host-123"      this replica's id (printable, no space, at most 200 bytes)
-- ARGV[2]  "1000"             TTL in ms (1 to 60000)
-- ARGV[3]  "{...}"            this replica's payload (JSON, opaque here)
-- ARGV[4]  "pcr:gateway:load-changes"   the channel (not a key: PUBLISH reaches every
--                             node of a cluster)
--
-- Returns: array of the other live replicas' ids and payloads, alternating.
-- Publishes: "<replica id> <payload>" on ARGV[4].
-- Calls:   TIME, HSET, HGETALL, HDEL, PUBLISH
local ttl = tonumber(ARGV[2])
if not ttl or ttl < 1 or ttl > 60000 then
  return redis.error_reply('ERR gateway_load: TTL must be 1 to 60000 ms')
end
local now = now_ms()
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d', now + ttl) .. ' ' .. ARGV[3])
local entries = redis.call('HGETALL', KEYS[1])
local others = {}
local expired = {}
for i = 1, #entries, 2 do
  local field, value = entries[i], entries[i + 1]
  local space = string.find(value, ' ', 1, true)
  local expires = space and tonumber(string.sub(value, 1, space - 1))
  if not expires or expires < now then
    expired[#expired + 1] = field
  elseif field ~= ARGV[1] then
    others[#others + 1] = field
    others[#others + 1] = string.sub(value, space + 1)
  end
end
for i = 1, #expired, 1000 do
  redis.call('HDEL', KEYS[1], unpack(expired, i, math.min(i + 999, #expired)))
end
redis.call('PUBLISH', ARGV[4], ARGV[1] .. ' ' .. ARGV[3])
return others
