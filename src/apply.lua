-- apply.lua: apply one batch of one Kafka partition behind its fence, atomically.
--
-- KEYS[1]       the fence key: last applied offset of (group, topic, partition)
-- KEYS[2..n]    counter keys <prefix>:likes:<post>:<bucket>
-- ARGV[1]       start: first offset the batch covers
-- ARGV[2]       last: last offset the batch covers
-- ARGV[3]       "1" when the caller has seen this fence before (its absence is a loss)
-- ARGV[4..]     one integer delta per counter key, in KEYS order
--
-- Returns {code, fence}; fence is the fence before the call, or -1 when absent.
--   0 applied: every delta added, fence set to last
--   1 duplicate: fence >= last, nothing written
--   2 straddle: start <= fence < last, nothing written; resume at fence + 1
--   3 gap: fence + 1 < start, or no fence where one was expected; nothing written
-- The decision table is src/fence.rs, which the tests hold this script to.

local raw = redis.call('GET', KEYS[1])
local start = tonumber(ARGV[1])
local last = tonumber(ARGV[2])

if raw then
  local fence = tonumber(raw)
  if fence >= last then
    return {1, fence}
  end
  if fence + 1 < start then
    return {3, fence}
  end
  if fence + 1 > start then
    return {2, fence}
  end
elseif ARGV[3] == '1' then
  return {3, -1}
end

for i = 2, #KEYS do
  redis.call('INCRBY', KEYS[i], ARGV[i + 2])
end
redis.call('SET', KEYS[1], ARGV[2])
return {0, raw and tonumber(raw) or -1}
