-- route_fetch.lua: read the writers' registry together with this server's clock,
-- optionally making routing final up to a time first.
--
-- KEYS[1]  the registry hash <prefix>:routes
-- ARGV[1]  optional: raise the registry's "final" field to at least this time
--          (milliseconds since the epoch); publications from then on take effect
--          only after it
-- ARGV[2..4]  with ARGV[1]: the partition, offset and timestamp of the event it is
--          raised for; nothing is raised when a record of "unfrozen" fixes that
--          event's route already (route_unfreeze.lua, src/domain/versions/unfreeze.rs)
-- Returns {now_ms, field1, value1, field2, value2, ...}; the clock, the raise and
-- the entries are one atomic step (the clock is registry_clock.lua's), so every version published after it is
-- effective later than both now_ms + grace and the final time.

local refused = acl_refusal({{'TIME'}, {'HGET', KEYS[1], 'f'}, {'HSET', KEYS[1], 'f', 'v'}, {'HGETALL', KEYS[1]}})
if refused then
  return refused
end

-- Whether an unfreeze record covers the event: stamped after its bound, at or
-- below its partition's cutoff.
local function unfrozen_route(partition, offset, timestamp)
  local records = redis.call('HGET', KEYS[1], 'unfrozen')
  if not records or not timestamp then
    return false
  end
  for record in string.gmatch(records, '[^|]+') do
    local bound, cutoffs = string.match(record, '^(%-?%d+)/([^/]*)/')
    if bound and timestamp > tonumber(bound) then
      for p, o in string.gmatch(cutoffs, '(%d+):(%-?%d+)') do
        if tonumber(p) == partition and offset <= tonumber(o) then
          return true
        end
      end
    end
  end
  return false
end

local reply = {registry_now(KEYS[1])}
if ARGV[1] and not unfrozen_route(tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])) then
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
