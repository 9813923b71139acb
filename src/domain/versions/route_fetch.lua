-- route_fetch.lua: read the writers' registry together with this server's clock,
-- optionally making routing final up to a time first.
--
-- KEYS[1]  the registry hash <prefix>:routes
-- ARGV[1]  optional: raise the registry's "final" field to at least this time
--          (milliseconds since the epoch); publications from then on take effect
--          only after it
-- Returns {now_ms, field1, value1, field2, value2, ...}; the clock, the raise and
-- the entries are one atomic step (the clock is registry_clock.lua's), so every version published after it is
-- effective later than both now_ms + grace and the final time.

local refused = acl_refusal({{'TIME'}, {'HGET', KEYS[1], 'f'}, {'HSET', KEYS[1], 'f', 'v'}, {'HGETALL', KEYS[1]}})
if refused then
  return refused
end

local reply = {registry_now(KEYS[1])}
if ARGV[1] then
  local final = tonumber(redis.call('HGET', KEYS[1], 'final') or '0')
  if final < tonumber(ARGV[1]) then
    redis.call('HSET', KEYS[1], 'final', ARGV[1])
  end
end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all do
  reply[i + 1] = all[i]
end
return reply
