-- apply_packed.lua: apply.lua for a packed generation, whose counters are
-- fields of small hashes: the same fence, the same decisions, all or nothing.
-- The hashes are a fixed number, or grow: they split as they fill, in the
-- order of linear hashing, by the split state of the slot group
-- (src/domain/packing.rs states why no count is lost, doubled or seen to go
-- down while they do).
--
-- KEYS[1]       the group's fence key (same hash slot as every hash)
-- KEYS[2]       growing only: the group's split state, a hash of level, next
--               and fields (absent: 0, 0, 0)
-- KEYS[..]      the hashes <prefix>:packed:<n>[:{tag}] the counters live in,
--               then, for each of W windows, its counts and its leaders (windows.lua)
-- ARGV[1]       start: first offset the range covers (one past the fence the caller believes)
-- ARGV[2]       last: last offset the range covers
-- ARGV[3]       the fence to assume when the key is absent: the partition's origin - 1
-- ARGV[4]       W, the number of windows written
-- ARGV[5]       fields a hash holds on average before the next one splits,
--               or 0 for a fixed number of hashes
-- growing only:
-- ARGV[6..7]    the split state (level, next) the caller addressed with
-- ARGV[8..9]    a hash's key is ARGV[8] .. n .. ARGV[9]
-- then, for each hash in order: n, its number, and m, then m pairs
--               (field, delta); then the window section (windows.lua)
--
-- Returns {code, fence, fill} (growing: {code, fence, fill, level, next},
-- the split state after the call); fence is the fence found before the
-- call, fill the fields of one hash it wrote, after it (0 when nothing was
-- written): the hash picked by the range's last offset, so that successive
-- calls sample different hashes for one HLEN each.
--   0 applied: every delta added, fence set to last
--   1 duplicate: fence >= last; nothing written
--   2 straddle: start <= fence < last; nothing written
--   3 gap: fence + 1 < start; nothing written
--   4 refused: {4, fence, i, error, field, key}: HINCRBY refused field of
--     the hash key, KEYS[i] or, when KEYS[i] was split since, the hash the
--     field lives in now (a value that is not an integer, a key of another
--     type, an overflow),
--     or {4, fence, i, error} for a window key KEYS[i] of another type or
--     with a floor that is not an integer, or {4, fence, i, error, member}
--     when HINCRBY refused the post member of the window counts KEYS[i];
--     the deltas already added are taken back, so no count changes and the
--     fence stays
--   5 resplit: {5, fence, 0, level, next}: the call would have filled a
--     hash past what the server keeps compact, and the script split hashes
--     to make room first; no count written, the fence stays; address again
--     with (level, next)
-- A hash the call names that was split since the state it was addressed
-- with is not refused: the fields the call names under it are written where
-- the split state says now (field_hash.lua), and taken back from there by an
-- undo. Such a hash in a slot being migrated away answers with an error
-- reply (TRYAGAIN): nothing written, the call is tried again.
-- An error reply (NOPERM) when the caller's ACL lacks a command the script
-- may call, or (ERR) when the fence key holds what is not an offset or the
-- split state what tally does not write; nothing written.
-- A field the undo brings back to 0 is deleted, and a hash left empty goes
-- with its last field: absent reads as 0, and a refused call creates nothing.

-- A call splits as many hashes as the counters it created need (one per
-- `grow` of them) and CATCH_UP more while the group is behind: each split
-- moves a few dozen fields, so the splits cost a call a share of its own
-- writes, never a pause of their own, however fast its group grows.
local CATCH_UP = 4
-- The most splits that make room for one call before it is written.
local PRESPLIT_MAX = 4096
local MAX_LEVEL = 30

local fence, skipped = fence_decision()
if not fence then
  return skipped
end
if skipped then
  return {skipped, fence, 0}
end
local last = tonumber(ARGV[2])

local pcall, keys, argv, kind = redis.pcall, KEYS, ARGV, type

local grow = tonumber(argv[5])
if not grow or grow < 0 or grow % 1 ~= 0 then
  return redis.error_reply('ERR apply_packed.lua: ARGV[5] must be the fields a hash holds before a split, or 0')
end
local first, at0 = 2, 6
if grow > 0 then
  first, at0 = 3, 10
end

-- Every command the script may run is checked before the first write: a
-- user without one would otherwise stop it half-way (see apply.lua).
local calls = {{'HINCRBY', KEYS[1], 'f', '0'}, {'HDEL', KEYS[1], 'f'}, {'HLEN', KEYS[1]}, {'SET', KEYS[1], '0'}}
if grow > 0 then
  calls[#calls + 1] = {'HMGET', KEYS[1], 'f'}
  calls[#calls + 1] = {'HGETALL', KEYS[1]}
  calls[#calls + 1] = {'HSET', KEYS[1], 'f', '0'}
end
local denied = acl_refusal(calls)
if denied then
  return denied
end

-- The arguments must cover every key, each with whole pairs.
local w = tonumber(argv[4])
if not w or w < 0 or w % 1 ~= 0 or 2 * w > #keys - first + 1 then
  return redis.error_reply('ERR apply_packed.lua: ARGV[4] must count the windows whose key pairs end KEYS')
end
local hashes = #keys - 2 * w
local a, covered = at0, first - 1
while covered < hashes and a + 1 <= #argv do
  local m = tonumber(argv[a + 1])
  if not m or m < 0 or m % 1 ~= 0 or not tonumber(argv[a]) then
    break
  end
  a = a + 2 + 2 * m
  covered = covered + 1
end
if covered ~= hashes or a > #argv + 1 or not windows_shaped(argv, a, w) then
  return redis.error_reply('ERR apply_packed.lua: ARGV does not give a number, a count and whole (field, delta) pairs for each of the ' .. (hashes - first + 1) .. ' hashes of KEYS, or the window section is not whole')
end

-- The split state, and whether every hash the call names is where the
-- caller's state put it.
local level, nxt, count = 0, 0, 0
-- The hashes of the call split since the caller addressed them, by index in KEYS.
local moved_on = {}

-- Moves the fields of hash n whose hash has bit `level` set to hash
-- n + 2^level. False when the new hash refuses them (a key of another type,
-- a slot being migrated away): nothing moved, and the splits wait.
local function split(n)
  local stem, tail = argv[8], argv[9]
  local from = stem .. n .. tail
  local all = redis.call('HGETALL', from)
  local high, size = 2 ^ level, 2 ^ (level + 1)
  local moved, gone = {}, {}
  for i = 1, #all, 2 do
    if field_hash(all[i]) % size >= high then
      moved[#moved + 1] = all[i]
      moved[#moved + 1] = all[i + 1]
      gone[#gone + 1] = all[i]
    end
  end
  if #gone > 0 then
    local set = pcall('HSET', stem .. (n + high) .. tail, unpack(moved))
    if kind(set) == 'table' and set.err then
      return false
    end
    redis.call('HDEL', from, unpack(gone))
  end
  return true
end

-- Splits hashes in order while `wanted` counters would be more than `grow`
-- a hash, at most `budget` of them; returns how many it split.
local function split_until(wanted, budget)
  local splits = 0
  while wanted > grow * (2 ^ level + nxt) and splits < budget and level < MAX_LEVEL do
    if not split(nxt) then
      break
    end
    splits = splits + 1
    nxt = nxt + 1
    if nxt == 2 ^ level then
      level, nxt = level + 1, 0
    end
  end
  return splits
end

if grow > 0 then
  local raw = redis.call('HMGET', keys[2], 'level', 'next', 'fields')
  level, nxt, count = tonumber(raw[1] or '0'), tonumber(raw[2] or '0'), tonumber(raw[3] or '0')
  if not level or not nxt or not count or level % 1 ~= 0 or nxt % 1 ~= 0 or count % 1 ~= 0
      or level < 0 or level > MAX_LEVEL or nxt < 0 or nxt >= 2 ^ level or count < 0 then
    local function shown(v)
      if not v then
        return 'nothing'
      end
      return '"' .. v .. '"'
    end
    return redis.error_reply('ERR ' .. keys[2] .. ' holds level ' .. shown(raw[1]) .. ', next ' .. shown(raw[2]) .. ', fields ' .. shown(raw[3]) .. ', not a split state tally writes; where its counters are is lost: recount the prefix with `tally rebuild`')
  end
  local mine_level, mine_next = tonumber(argv[6]), tonumber(argv[7])
  if mine_level ~= level or mine_next ~= nxt then
    local at = at0
    for k = first, hashes do
      local n = tonumber(argv[at])
      local assumed = mine_level and mine_next and level_of(n, mine_level, mine_next)
      if not assumed or assumed ~= level_of(n, level, nxt) then
        moved_on[k] = true
      end
      at = at + 2 + 2 * tonumber(argv[at + 1])
    end
  end
  -- A hash the call would fill past what the server keeps compact (a new
  -- group, or a call much larger than its group) would turn into a
  -- hashtable for good, even once splits empty it again. The group is first
  -- split until it has room for every pair of the call, and the call is
  -- refused with the new state, no count written, to be addressed anew.
  -- Only a hash named by more pairs than the fullest hashes leave room for
  -- is looked at, so a call of a grown group pays nothing for it.
  local safe = 2 * grow + 5 * math.sqrt(2 * grow)
  local room = safe - 2 * math.ceil(count / (2 ^ level + nxt))
  local at, pairs_named, crowded = at0, 0, false
  for k = first, hashes do
    local m = tonumber(argv[at + 1])
    pairs_named = pairs_named + m
    if m > room and not crowded then
      crowded = redis.call('HLEN', keys[k]) + m > safe
    end
    at = at + 2 + 2 * m
  end
  if crowded and split_until(count + pairs_named, PRESPLIT_MAX) > 0 then
    redis.call('HSET', keys[2], 'level', level, 'next', nxt, 'fields', count)
    return {5, fence, 0, level, nxt}
  end
end

local refusal, floors = windows_refusal(keys, w, fence)
if refusal then
  return refusal
end

-- Takes back every delta before pair p of KEYS[upto] (and all of the keys
-- before it).
-- The hash a field the call names under KEYS[k] is written to: KEYS[k], or,
-- when that hash was split since the caller addressed it, the hash the split
-- state names now (the state does not change until the writes are done).
local function target(k, field)
  if not moved_on[k] then
    return keys[k]
  end
  local h = field_hash(field)
  local n = h % 2 ^ level
  if n < nxt then
    n = h % 2 ^ (level + 1)
  end
  return argv[8] .. n .. argv[9]
end

local function undo(upto, p)
  local at = at0
  for k = first, upto do
    local m = tonumber(argv[at + 1])
    local stop = m
    if k == upto then
      stop = p - 1
    end
    for j = 1, stop do
      local field = argv[at + 2 * j]
      local key = target(k, field)
      if redis.call('HINCRBY', key, field, -tonumber(argv[at + 2 * j + 1])) == 0 then
        redis.call('HDEL', key, field)
      end
    end
    at = at + 2 + 2 * m
  end
end

-- New fields are counted (a field whose value after the write is its delta:
-- new, or back from 0) for the split state.
local at, created = at0, 0
for k = first, hashes do
  local key, moved = keys[k], moved_on[k]
  local m = tonumber(argv[at + 1])
  for j = 1, m do
    local field, delta = argv[at + 2 * j], argv[at + 2 * j + 1]
    if moved then
      key = target(k, field)
    end
    local added = pcall('HINCRBY', key, field, delta)
    if kind(added) == 'table' then
      undo(k, j)
      if moved and string.find(added.err, 'non local key', 1, true) then
        -- A hash the call did not name lives in a slot being migrated away:
        -- nothing is written, and the call is tried again once it has moved.
        return redis.error_reply('TRYAGAIN apply_packed.lua: ' .. key .. ' is in a slot being migrated; nothing written')
      end
      return {4, fence, k, added.err, field, key}
    end
    if grow > 0 and added == tonumber(delta) then
      created = created + 1
    end
  end
  at = at + 2 + 2 * m
end
local refused = apply_windows(keys, argv, at, w, floors)
if refused then
  -- A window's count refused its addition; the windows took theirs back.
  undo(hashes + 1, 1)
  return {4, fence, refused[1], refused[2], refused[3]}
end
local fill = 0
if hashes >= first then
  fill = redis.call('HLEN', keys[first + last % (hashes - first + 1)])
end

if grow > 0 then
  count = count + created
  local splits = split_until(count, math.ceil(created / grow) + CATCH_UP)
  if created > 0 or splits > 0 then
    redis.call('HSET', keys[2], 'level', level, 'next', nxt, 'fields', count)
  end
  redis.call('SET', KEYS[1], ARGV[2])
  return {0, fence, fill, level, nxt}
end
redis.call('SET', KEYS[1], ARGV[2])
return {0, fence, fill}
