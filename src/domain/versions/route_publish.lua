-- route_publish.lua: publish a new routing version of one post in the writers' registry.
--
-- KEYS[1]  the registry hash <prefix>:routes (field: post id, value: its versions)
-- ARGV[1]  post id
-- ARGV[2]  the version to publish (reserved in the post's route hash beforehand)
-- ARGV[3]  its bucket count
-- ARGV[4]  grace in milliseconds: the version routes events stamped this long
--          after now (the registry's clock, registry_clock.lua) and later
-- ARGV[5]  the post's version-0 bucket count, used when it has no entry yet
-- ARGV[6]  "1" to publish only if the post's latest bucket count is below ARGV[3]
--          (automatic promotion: another consumer may have promoted it already)
-- ARGV[7]  the default layout's newest bucket count as the caller read it: the
--          post's latest count while it has no version of its own
--
-- An entry is "version:buckets:effective_ms" items joined by ";", oldest first;
-- it only ever grows, and effective times strictly increase. A version takes
-- effect after the registry's "final" time too.
-- Returns {published (0 or 1), entry}.

local refused = acl_refusal({{'TIME'}, {'HGET', KEYS[1], 'f'}, {'HSET', KEYS[1], 'f', 'v'}})
if refused then
  return refused
end

local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then
  entry = '0:' .. ARGV[5] .. ':0'
end
local last_version, last_buckets, last_effective = string.match(entry, '(%d+):(%d+):(%-?%d+)$')
last_version = tonumber(last_version)
last_buckets = tonumber(last_buckets)
last_effective = tonumber(last_effective)
if last_version == 0 then
  last_buckets = tonumber(ARGV[7])
end

local version = tonumber(ARGV[2])
local buckets = tonumber(ARGV[3])
if version <= last_version then
  return {0, entry}
end
if ARGV[6] == '1' and last_buckets >= buckets then
  return {0, entry}
end

local effective = effective_after(KEYS[1], registry_now(KEYS[1]) + tonumber(ARGV[4]), last_effective)
entry = entry .. ';' .. version .. ':' .. buckets .. ':' .. effective
redis.call('HSET', KEYS[1], ARGV[1], entry)
return {1, entry}
