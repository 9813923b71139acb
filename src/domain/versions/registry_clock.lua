-- registry_clock.lua: the routing registry's clock, which never goes back.
--
-- Prepended to every script that reads the clock of the registry (fetch,
-- publish, rebucket). A failover can promote a replica whose TIME is behind
-- the old primary's; the registry keeps the highest time it has handed out
-- in its field "clock" (written at most once a second) and never answers
-- with less. What a regression below that costs is bounded by the write
-- interval plus replication lag, well inside GRACE_MS - AHEAD_MS, which
-- versions.rs shows is what routing tolerates.

local function registry_now(registry)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local seen = tonumber(redis.call('HGET', registry, 'clock') or '0')
  if now > seen + 1000 then
    redis.call('HSET', registry, 'clock', now)
  end
  if now < seen then
    return seen
  end
  return now
end

