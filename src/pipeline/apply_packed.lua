-- apply_packed.lua: apply.lua for a packed generation, whose counters are
-- fields of small hashes: the same fence, the same decisions, all or nothing.
--
-- KEYS[1]       the group's fence key (same hash slot as every hash)
-- KEYS[2..]     the hashes <prefix>:packed:<n>[:{tag}] the counters live in,
--               then, for each of W windows, its counts and its leaders (windows.lua)
-- ARGV[1]       start: first offset the range covers (one past the fence the caller believes)
-- ARGV[2]       last: last offset the range covers
-- ARGV[3]       the fence to assume when the key is absent: the partition's origin - 1
-- ARGV[4]       W, the number of windows written
-- ARGV[5..]     for each hash in order: m, then m pairs (field, delta); then
--               the window section (windows.lua)
--
-- Returns {code, fence, fill}; fence is the fence found before the call, fill
-- the fields of one hash it wrote, after it (0 when nothing was written): the
-- hash picked by the range's last offset, so that successive calls sample
-- different hashes for one HLEN each (every hash of a generation fills alike).
--   0 applied: every delta added, fence set to last
--   1 duplicate: fence >= last; nothing written
--   2 straddle: start <= fence < last; nothing written
--   3 gap: fence + 1 < start; nothing written
--   4 refused: {4, fence, i, error, field}: HINCRBY refused field of KEYS[i]
--     (a value that is not an integer, a key of another type, an overflow),
--     or {4, fence, i, error} for a window key KEYS[i] of another type or
--     with a floor that is not an integer, or {4, fence, i, error, member}
--     when HINCRBY refused the post member of the window counts KEYS[i];
--     the deltas already added are taken back, so no count changes and the
--     fence stays
-- An error reply (NOPERM) when the caller's ACL lacks a command the script
-- may call, or (ERR) when the fence key holds what is not an offset; nothing
-- written.
-- A field the undo brings back to 0 is deleted, and a hash left empty goes
-- with its last field: absent reads as 0, and a refused call creates nothing.

local fence, skipped = fence_decision()
if not fence then
  return skipped
end
if skipped then
  return {skipped, fence, 0}
end
local last = tonumber(ARGV[2])

-- Every command the script may run is checked before the first write: a
-- user without one would otherwise stop it half-way (see apply.lua).
local denied = acl_refusal({{'HINCRBY', KEYS[1], 'f', '0'}, {'HDEL', KEYS[1], 'f'}, {'HLEN', KEYS[1]}, {'SET', KEYS[1], '0'}})
if denied then
  return denied
end

local pcall, keys, argv, kind = redis.pcall, KEYS, ARGV, type

-- The arguments must cover every key, each with whole pairs.
local w = tonumber(argv[4])
if not w or w < 0 or w % 1 ~= 0 or 2 * w > #keys - 1 then
  return redis.error_reply('ERR apply_packed.lua: ARGV[4] must count the windows whose key pairs end KEYS')
end
local hashes = #keys - 2 * w
local a, covered = 5, 1
while covered < hashes and a <= #argv do
  local m = tonumber(argv[a])
  if not m or m < 0 or m % 1 ~= 0 then
    break
  end
  a = a + 1 + 2 * m
  covered = covered + 1
end
if covered ~= hashes or a > #argv + 1 or not windows_shaped(argv, a, w) then
  return redis.error_reply('ERR apply_packed.lua: ARGV[5..] does not give whole (field, delta) pairs for each of the ' .. (hashes - 1) .. ' hashes of KEYS, or the window section is not whole')
end
local refusal, floors = windows_refusal(keys, w, fence)
if refusal then
  return refusal
end

-- Takes back every delta before pair p of KEYS[upto] (and all of the keys
-- before it).
local function undo(upto, p)
  local at = 5
  for k = 2, upto do
    local m = tonumber(argv[at])
    local stop = m
    if k == upto then
      stop = p - 1
    end
    for j = 1, stop do
      local field = argv[at + 2 * j - 1]
      if redis.call('HINCRBY', keys[k], field, -tonumber(argv[at + 2 * j])) == 0 then
        redis.call('HDEL', keys[k], field)
      end
    end
    at = at + 1 + 2 * m
  end
end

local at = 5
for k = 2, hashes do
  local key = keys[k]
  local m = tonumber(argv[at])
  for j = 1, m do
    local field = argv[at + 2 * j - 1]
    local added = pcall('HINCRBY', key, field, argv[at + 2 * j])
    if kind(added) == 'table' then
      undo(k, j)
      return {4, fence, k, added.err, field}
    end
  end
  at = at + 1 + 2 * m
end
local refused = apply_windows(keys, argv, at, w, floors)
if refused then
  -- A window's count refused its addition; the windows took theirs back.
  undo(hashes + 1, 1)
  return {4, fence, refused[1], refused[2], refused[3]}
end
local fill = 0
if hashes > 1 then
  fill = redis.call('HLEN', keys[2 + last % (hashes - 1)])
end
redis.call('SET', KEYS[1], ARGV[2])
return {0, fence, fill}
