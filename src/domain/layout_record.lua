-- layout_record.lua: writes a prefix's layout record unless one exists, and
-- returns the record in force.
--
-- KEYS[1]  the record, <prefix>:layout (a hash)
-- ARGV     field, value, field, value, ... of the proposed record
--
-- Returns {written, field, value, field, value, ...}: written is 1 when this
-- call created the record, 0 when one was already there (it is left as is).
-- Two first starters with different settings cannot both write: the check
-- and the write are one step.
local refused = acl_refusal({{'EXISTS', KEYS[1]}, {'HSET', KEYS[1], 'f', 'v'}, {'HGETALL', KEYS[1]}})
if refused then
  return refused
end

local written = 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV))
  written = 1
end
local reply = redis.call('HGETALL', KEYS[1])
table.insert(reply, 1, tostring(written))
return reply
