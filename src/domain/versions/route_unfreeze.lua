-- route_unfreeze.lua: bring routing made final far ahead back to the registry clock
-- (tally unfreeze-routing), in two steps, or give an unfreeze up.
--
-- KEYS[1]  the registry hash <prefix>:routes
-- ARGV[1]  'begin', 'finish' or 'abort'
--
-- begin   ARGV[2] frozen: routing must be final more than this many ms ahead of the clock
--         ARGV[3] grace ms: "final" is lowered to now + grace
--   Lowers "final" and records {undone}:{bound}:{started} in "unfreezing"; while it is
--   there, publications take effect after the undone time still (route_publish.lua,
--   route_default.lua). Again during an unfreeze: starts it over, undoing the higher time.
--   Returns {0, started, undone, bound}, or {1, now, final} when not frozen.
-- finish  ARGV[2] the started time begin returned (the unfreeze's token)
--         ARGV[3] ms that must have passed since it began, by this clock
--         ARGV[4] frozen ms, as for begin; ARGV[5] grace ms
--         ARGV[6] cutoffs "partition:offset,...": the last offset of each partition that
--                 may have been counted under the frozen routing
--   Every version effective after the bound (published while frozen) takes effect from
--   now + grace instead (after "final", and in order); "unfrozen" gains the record
--   "bound/cutoffs/owner=k:buckets:effective_ms,..." with those versions' times of then,
--   which keeps the routes of the events counted before (src/domain/versions/unfreeze.rs).
--   Returns {0, now, final, bound, moved} done; {1, now} none under way; {2, now, started}
--   another began since; {3, now, started} too early; {4, now, final} routing was made
--   final further than frozen ms ahead meanwhile; {5, now, field, effective, final} a
--   version published before the start takes effect at or before "final". On 4 and 5 the
--   undone time is restored to "final" and "unfreezing" dropped; nothing else changes.
-- abort   ARGV[2] the started time: restores as on 4 if that unfreeze is under way.
--   Returns {0, now} restored, or {1, now}.
-- Everything is checked before the first write.

local refused = acl_refusal({{'TIME'}, {'HGET', KEYS[1], 'f'}, {'HSET', KEYS[1], 'f', 'v'},
  {'HDEL', KEYS[1], 'f'}, {'HGETALL', KEYS[1]}})
if refused then
  return refused
end

local registry = KEYS[1]
local now = registry_now(registry)
local final = tonumber(redis.call('HGET', registry, 'final') or '0')
local marker = redis.call('HGET', registry, 'unfreezing')
local undone, bound, started
if marker then
  undone, bound, started = string.match(marker, '^(%-?%d+):(%-?%d+):(%-?%d+)$')
  if not undone then
    return redis.error_reply('unreadable field unfreezing in ' .. registry .. ': ' .. marker)
  end
  undone, bound, started = tonumber(undone), tonumber(bound), tonumber(started)
end

-- Routing final up to the undone time again, as before the unfreeze began.
local function restore()
  if final < undone then
    redis.call('HSET', registry, 'final', undone)
  end
  redis.call('HDEL', registry, 'unfreezing')
end

local step = ARGV[1]
if step == 'begin' then
  local frozen = final
  if undone and undone > frozen then
    frozen = undone
  end
  if frozen - now <= tonumber(ARGV[2]) then
    return {1, now, frozen}
  end
  local lowered = now + tonumber(ARGV[3])
  redis.call('HSET', registry, 'unfreezing', frozen .. ':' .. lowered .. ':' .. now)
  redis.call('HSET', registry, 'final', lowered)
  return {0, now, frozen, lowered}
end

if step == 'abort' then
  if marker and started == tonumber(ARGV[2]) then
    restore()
    return {0, now}
  end
  return {1, now}
end

if step ~= 'finish' then
  return redis.error_reply('route_unfreeze.lua: unknown step ' .. tostring(step))
end
if not marker then
  return {1, now}
end
if started ~= tonumber(ARGV[2]) then
  return {2, now, started}
end
if now < started + tonumber(ARGV[3]) then
  return {3, now, started}
end
if final - now > tonumber(ARGV[4]) then
  restore()
  return {4, now, final}
end

-- Versions effective after the bound: each post's entry and the default layout's.
local base = now + tonumber(ARGV[5])
if base <= final then
  base = final + 1
end
local all = redis.call('HGETALL', registry)
local rewrites, moved = {}, {}
for i = 1, #all, 2 do
  local field, entry = all[i], all[i + 1]
  if field == 'default' or string.match(field, '^%d+$') then
    local items, last, changed = {}, nil, false
    for item in string.gmatch(entry, '[^;]+') do
      local k, buckets, effective = string.match(item, '^(%d+):(%d+):(%-?%d+)$')
      if not k then
        return redis.error_reply('unreadable entry ' .. field .. ' in ' .. registry .. ': ' .. entry)
      end
      effective = tonumber(effective)
      if effective > bound then
        if effective <= final then
          restore()
          return {5, now, field, effective, final}
        end
        moved[#moved + 1] = field .. '=' .. k .. ':' .. buckets .. ':' .. effective
        local at = base
        if last and at <= last then
          at = last + 1
        end
        items[#items + 1] = k .. ':' .. buckets .. ':' .. at
        last, changed = at, true
      else
        items[#items + 1] = item
        last = effective
      end
    end
    if changed then
      rewrites[#rewrites + 1] = {field, table.concat(items, ';')}
    end
  end
end

for _, rewrite in ipairs(rewrites) do
  redis.call('HSET', registry, rewrite[1], rewrite[2])
end
local record = bound .. '/' .. ARGV[6] .. '/' .. table.concat(moved, ',')
local before = redis.call('HGET', registry, 'unfrozen')
if before then
  record = before .. '|' .. record
end
redis.call('HSET', registry, 'unfrozen', record)
redis.call('HDEL', registry, 'unfreezing')
return {0, now, final, bound, #moved}
