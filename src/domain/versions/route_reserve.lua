-- route_reserve.lua: reserve the next routing version of a post in its route hash.
--
-- KEYS[1]  the post's route hash <prefix>:route:<post>, read by readers
-- ARGV[1]  bucket count of the new version
-- ARGV[2]  version-0 bucket count, recorded if the post has none yet
-- ARGV[3]  the latest version the caller saw published: the new one is above it
--
-- Adds field v<k> = buckets before any writer can learn of version k, so a
-- reader that reads this hash sums every key a writer may use.
-- Returns {k, v0 buckets}.

local refused = acl_refusal({{'HSETNX', KEYS[1], 'f', 'v'}, {'HGET', KEYS[1], 'f'}, {'HSET', KEYS[1], 'f', 'v'}, {'HINCRBY', KEYS[1], 'f', '1'}})
if refused then
  return refused
end

redis.call('HSETNX', KEYS[1], 'v0', ARGV[2])
local seen = tonumber(ARGV[3])
if tonumber(redis.call('HGET', KEYS[1], 'next') or '0') < seen then
  redis.call('HSET', KEYS[1], 'next', seen)
end
local version = redis.call('HINCRBY', KEYS[1], 'next', 1)
redis.call('HSET', KEYS[1], 'v' .. version, ARGV[1])
return {version, tonumber(redis.call('HGET', KEYS[1], 'v0'))}
