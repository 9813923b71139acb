-- route_fetch.lua: read the writers' registry together with this server's clock.
--
-- KEYS[1]  the registry hash <prefix>:routes
-- Returns {now_ms, post1, entry1, post2, entry2, ...}; the clock and the
-- entries come from one atomic read, so every version published after it is
-- effective later than now_ms + grace.

local now = redis.call('TIME')
local reply = {tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all do
  reply[i + 1] = all[i]
end
return reply
