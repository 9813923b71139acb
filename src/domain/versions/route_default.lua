-- route_default.lua: publish a new epoch of the default layout in the writers' registry.
--
-- KEYS[1]  the registry hash <prefix>:routes
-- ARGV[1]  the registry field of the default layout ("default")
-- ARGV[2]  epoch 0's bucket count (the layout record's), used when the field is absent
-- ARGV[3]  the bucket count of the new epoch
-- ARGV[4]  grace in milliseconds: the epoch routes events stamped this long
--          after now (the registry's clock, registry_clock.lua) and later
--
-- The field is "epoch:buckets:effective_ms" items joined by ";", oldest first,
-- in the format of a post's entry; it only ever grows, and effective times
-- strictly increase, and come after the registry's "final" time. Nothing is
-- added when the newest epoch already has ARGV[3] buckets.
-- Returns {added (0 or 1), now_ms, entry}.

local refused = acl_refusal({{'TIME'}, {'HGET', KEYS[1], 'f'}, {'HSET', KEYS[1], 'f', 'v'}})
if refused then
  return refused
end

local now_ms = registry_now(KEYS[1])
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then
  entry = '0:' .. ARGV[2] .. ':0'
end
local last_epoch, last_buckets, last_effective = string.match(entry, '(%d+):(%d+):(%-?%d+)$')
if not last_epoch then
  return redis.error_reply('unreadable default layout in ' .. KEYS[1] .. ': ' .. entry)
end
if tonumber(last_buckets) == tonumber(ARGV[3]) then
  return {0, now_ms, entry}
end
local effective = effective_after(KEYS[1], now_ms + tonumber(ARGV[4]), tonumber(last_effective))
entry = entry .. ';' .. (tonumber(last_epoch) + 1) .. ':' .. ARGV[3] .. ':' .. effective
redis.call('HSET', KEYS[1], ARGV[1], entry)
return {1, now_ms, entry}
