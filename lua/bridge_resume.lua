-- bridge_resume: a restarted `pcr bridge` takes over the namespace it was following
-- without dropping it: a new epoch (so the previous bridge process, if it still runs,
-- is fenced) and a new lease, keeping the entries, but only when the namespace is
-- still a live bridged namespace of the same engine endpoint. Otherwise it changes
-- nothing and the bridge claims the namespace afresh (empty).
--
-- KEYS[1]  pcr:{node-0}:reply:5f1c2a9b03e1-7   this request's reply record
-- KEYS[2]  pcr:{node-0}:meta                    HASH epoch, lease_until, bridge_* fields
-- ARGV[1]  ""                                   (never fenced)
-- ARGV[2]  "5f1c2a9b03e1-7"                     request id
-- ARGV[3]  "30000"                              how long the reply is kept (ms)
-- ARGV[4]  "10000"                              lease length in milliseconds
-- ARGV[5]  "tcp://10.0.0.7:5557"                the engine endpoint the caller follows
--
-- Returns: { new epoch, lease end (ms), last applied engine seq ("" if none yet),
--            block size ("" if not known yet) } when resumed, all as text;
--          {} when the namespace is not a live bridged namespace of that endpoint.
-- Calls:   GET, HMGET, TIME, HGET, HSET, SET
local early = begin_write(KEYS[2])
if early then return early end
local meta = redis.call('HMGET', KEYS[2], 'lease_until', 'bridge_endpoint', 'bridge_seq',
  'bridge_block_size')
local lease_until, endpoint = tonumber(meta[1]), meta[2]
if not lease_until or lease_until <= now_ms() or endpoint ~= ARGV[5] then
  return finish_write({})
end
local epoch = new_epoch(KEYS[2])
local until_text = digits(now_ms() + tonumber(ARGV[4]))
redis.call('HSET', KEYS[2], 'epoch', epoch, 'lease_until', until_text)
return finish_write({epoch, until_text, meta[3] or '', meta[4] or ''})
