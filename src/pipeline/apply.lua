-- apply.lua: apply one slot group's share of a batch behind its fence, atomically.
--
-- KEYS[1]       the group's fence key (same hash slot as every counter key)
-- KEYS[2..]     counter keys <prefix>:likes:<post>:<bucket>[:{tag}], then
--               then, for each of W windows, its counts and its leaders
--               (windows.lua)
-- ARGV[1]       start: first offset the range covers (one past the fence the caller believes)
-- ARGV[2]       last: last offset the range covers
-- ARGV[3]       the fence to assume when the key is absent: the partition's origin - 1
-- ARGV[4]       W, the number of windows written
-- ARGV[5..]     the deltas as runs, in KEYS order: pairs (delta, n), each
--               adding delta to the next n counter keys; the n sum to #KEYS - 1 - 2W;
--               then the window section (windows.lua)
--
-- Returns {code, fence}; fence is the fence found before the call.
--   0 applied: every delta added, fence set to last
--   1 duplicate: fence >= last; nothing written
--   2 straddle: start <= fence < last; nothing written
--   3 gap: fence + 1 < start; nothing written
--   4 refused: {4, fence, i, error}: INCRBY refused KEYS[i] (a value that is not
--     an integer, another type, an overflow), or KEYS[i] is a window key of
--     another type or its floor is not an integer; {4, fence, i, error,
--     member} when HINCRBY refused the post member of the window counts
--     KEYS[i]; the deltas already added are taken back, so no count changes
--     and the fence stays
-- An error reply (NOPERM) when the caller's ACL lacks a command the script
-- may call, or (ERR) when the fence key holds what is not an offset; nothing
-- written.
-- Codes 0-3 are the decision table of src/domain/fence.rs; the tests hold this
-- script to it. A script that stopped on an error would keep the INCRBYs made
-- before it, and every retry would add them again: hence pcall and the undo.

local fence, skipped = fence_decision()
if not fence then
  return skipped
end
if skipped then
  return {skipped, fence}
end

-- Every command the script may call is checked before its first write
-- (acl_check.lua): a user without one would stop it half-way, its INCRBYs
-- kept and the fence not moved. KEYS were checked when it was called.
local denied = acl_refusal({{'INCRBY', KEYS[1], '0'}, {'DECRBY', KEYS[1], '0'}, {'DEL', KEYS[1]}, {'SET', KEYS[1], '0'}})
if denied then
  return denied
end

-- The loop does no more than one INCRBY per key: it runs for every counter
-- of every batch, so what it touches is held in locals (a global is a table
-- lookup per use) and a delta shared by many keys is one argument for all of
-- them. A key the undo brings back to 0 is deleted: it held 0 before
-- (absent, or "0"), absent reads as 0, and the failed call creates no keys.
local pcall, keys, argv, kind = redis.pcall, KEYS, ARGV, type
local w = tonumber(argv[4])
if not w or w < 0 or w % 1 ~= 0 or 2 * w > #keys - 1 then
  return redis.error_reply('ERR apply.lua: ARGV[4] must count the windows whose key pairs end KEYS')
end
local counters = #keys - 1 - 2 * w
local counted, at, whole = 0, 5, true
while counted < counters do
  local n = tonumber(argv[at + 1])
  if not n or n < 0 or n % 1 ~= 0 or not tonumber(argv[at]) then
    whole = false
    break
  end
  counted = counted + n
  at = at + 2
end
if not whole or counted ~= counters or not windows_shaped(argv, at, w) then
  return redis.error_reply('ERR apply.lua: the runs of ARGV[5..] cover ' .. counted .. ' keys, KEYS names ' .. counters .. ' counters, or the window section is not whole')
end
local refusal, floors = windows_refusal(keys, w, fence)
if refusal then
  return refusal
end

local function undo(upto)
  local k = 2
  for r = 5, at - 1, 2 do
    local delta = argv[r]
    for _ = 1, tonumber(argv[r + 1]) do
      if k > upto then
        return
      end
      if redis.call('DECRBY', keys[k], delta) == 0 then
        redis.call('DEL', keys[k])
      end
      k = k + 1
    end
  end
end

local k = 2
for r = 5, at - 1, 2 do
  local delta = argv[r]
  for _ = 1, tonumber(argv[r + 1]) do
    local added = pcall('INCRBY', keys[k], delta)
    if kind(added) == 'table' then
      undo(k - 1)
      return {4, fence, k, added.err}
    end
    k = k + 1
  end
end
local refused = apply_windows(keys, argv, at, w, floors)
if refused then
  -- A window's count refused its addition; the windows took theirs back.
  undo(counters + 1)
  return {4, fence, refused[1], refused[2], refused[3]}
end
redis.call('SET', KEYS[1], ARGV[2])
return {0, fence}
