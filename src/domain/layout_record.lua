-- layout_record.lua: writes a prefix's layout record unless one exists,
-- raises an existing record of an older format the caller reads to the
-- caller's format, and returns the record in force.
--
-- KEYS[1]  the record, <prefix>:layout (a hash)
-- ARGV[1]  the oldest format the caller reads (and may raise)
-- ARGV[2]  the format an existing record of an older format is raised to
-- ARGV[3..] field, value, field, value, ... of the proposed record
--
-- Returns {outcome, field, value, field, value, ...}: outcome is 1 when this
-- call created the record, 2 when it raised the record's format (nothing else
-- of it changes), 0 when the record was left as is. Two first starters with
-- different settings cannot both write: the check and the write are one
-- step. A record of a newer format than the caller's is never lowered.
local refused = acl_refusal({{'EXISTS', KEYS[1]}, {'HSET', KEYS[1], 'f', 'v'}, {'HGET', KEYS[1], 'format'}, {'HGETALL', KEYS[1]}})
if refused then
  return refused
end

local oldest = tonumber(ARGV[1])
local format = tonumber(ARGV[2])
local fields = {}
for i = 3, #ARGV, 2 do
  table.insert(fields, ARGV[i])
  table.insert(fields, ARGV[i + 1])
end

local outcome = 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], unpack(fields))
  outcome = 1
else
  local stored = tonumber(redis.call('HGET', KEYS[1], 'format'))
  if stored and format and stored >= oldest and stored < format then
    redis.call('HSET', KEYS[1], 'format', format)
    outcome = 2
  end
end
local reply = redis.call('HGETALL', KEYS[1])
table.insert(reply, 1, tostring(outcome))
return reply
