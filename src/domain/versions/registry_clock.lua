-- registry_clock.lua: the routing registry's clock, which never goes back,
-- and the earliest time a new routing epoch or version may take effect.
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


-- The time a new epoch or version asked to take effect at `wanted` takes
-- effect: never at or before a time routing was made final for (the field
-- "final", route_fetch.lua), nor, while an unfreeze is under way, the time it
-- undoes (route_unfreeze.lua), nor `last`, the newest effective time of the
-- entry it is added to, so that effective times strictly increase.
local function effective_after(registry, wanted, last)
  local final = tonumber(redis.call('HGET', registry, 'final') or '0')
  local undone = tonumber(string.match(redis.call('HGET', registry, 'unfreezing') or '', '^(%-?%d+):') or '0')
  local taken = math.max(final, undone, last)
  if wanted <= taken then
    return taken + 1
  end
  return wanted
end
