-- windows.lua: the window section both apply scripts take after their
-- counters (see src/domain/windows.rs); this text is put before each script,
-- after acl_check.lua and apply_fence.lua.
--
-- ARGV[4]            W, the number of windows written, the last 2W keys of KEYS
-- KEYS[#KEYS-2W+1..] for each window, in pairs: its counts, the hash
--                    <prefix>:win:<size>:<start>[:{tag}] (field: the post as
--                    8 big-endian bytes, value: its net likes; field "floor":
--                    the leaders' floor, 1 when absent), then its leaders,
--                    the sorted set <prefix>:top:<size>:<start>[:{tag}]
-- ARGV[at..]         after the counters' arguments, for each window in KEYS
--                    order: expire_at (ms since the epoch), r, then r runs,
--                    each a delta, n, and the n members it is added to (a
--                    batch's window deltas are mostly +1: one argument a post)
--
-- The leaders hold exactly the posts whose count is at least the floor,
-- each scored with its count. A write keeps that true: a count that reaches
-- the floor enters or moves in the leaders, one that falls below it leaves.
-- When the leaders pass LEADERS_CAP members, the floor rises to the count
-- of the LEADERS_KEEP-th and every post below it leaves them, so the sorted
-- set (each write to it a walk of its skiplist) stays small while every
-- post's count stays in the hash. A call's leaders enter or move with one
-- ZADD and leave with one ZREM per ZSET_CHUNK posts: every command a script
-- calls costs the server its dispatch (lookup, ACL check, timing), about as
-- much as a write to a small sorted set.
--
-- Every key is checked before the script's first write: one of another type,
-- or a floor that is not an integer, is refused like a bad counter. A post's
-- count that is not an integer is found by its HINCRBY, which the script
-- takes back with everything else it added, so no call is kept half-way. A
-- count brought to 0 is removed (absent reads as 0), and PEXPIREAT with a
-- time already past deletes both keys: a write to an expired window keeps
-- nothing.

local LEADERS_CAP, LEADERS_KEEP = 4000, 2000
-- Members of one ZADD or ZREM: well within what unpack puts on the stack.
local ZSET_CHUNK = 1000

local function whole_count(v)
  local n = tonumber(v)
  return n and n >= 0 and n % 1 == 0 and n
end

-- Whether argv[at..] holds whole runs for each of the w windows, to its end.
local function windows_shaped(argv, at, w)
  local last = #argv
  for _ = 1, w do
    local r = whole_count(argv[at + 1])
    if not tonumber(argv[at]) or not r then
      return false
    end
    at = at + 2
    for _ = 1, r do
      local n = whole_count(argv[at + 1])
      if not tonumber(argv[at]) or not n then
        return false
      end
      at = at + 2 + n
    end
  end
  return at == last + 1
end

-- Takes back every window count added from the arguments before argv[stop]
-- (the window section starting at argv[at], its first counts at KEYS[first]).
local function undo_windows(keys, argv, at, first, stop)
  local a = at
  for k = first, #keys, 2 do
    local runs = tonumber(argv[a + 1])
    a = a + 2
    for _ = 1, runs do
      local delta, n = tonumber(argv[a]), tonumber(argv[a + 1])
      a = a + 2
      for _ = 1, n do
        if a >= stop then
          return
        end
        if redis.call('HINCRBY', keys[k], argv[a], -delta) == 0 then
          redis.call('HDEL', keys[k], argv[a])
        end
        a = a + 1
      end
    end
  end
end

-- Sends cmd with key and the values of list in calls of at most `chunk` of them.
local function call_chunked(cmd, key, list, n, chunk)
  for i = 1, n, chunk do
    redis.call(cmd, key, unpack(list, i, math.min(i + chunk - 1, n)))
  end
end

-- NOPERM for a window command the caller lacks, {4, fence, i, error} for a
-- key KEYS[i] of another type or a floor that is not an integer, or nil and
-- each window's floor by the index of its counts in KEYS.
local function windows_refusal(keys, w, fence)
  if w == 0 then
    return nil, {}
  end
  local first = #keys - 2 * w + 1
  local counts, leaders = keys[first], keys[first + 1]
  local denied = acl_refusal({{'HINCRBY', counts, 'm', '1'}, {'HDEL', counts, 'm'}, {'HGET', counts, 'm'}, {'HSET', counts, 'm', '1'},
      {'ZADD', leaders, '1', 'm'}, {'ZREM', leaders, 'm'}, {'ZCARD', leaders}, {'ZREVRANGE', leaders, '0', '0'},
      {'ZREMRANGEBYSCORE', leaders, '0', '0'}, {'PEXPIREAT', counts, '0'}, {'TYPE', counts}})
  if denied then
    return denied
  end
  for k = first, #keys do
    local want = (k - first) % 2 == 0 and 'hash' or 'zset'
    local kind = redis.call('TYPE', keys[k]).ok
    if kind ~= want and kind ~= 'none' then
      return {4, fence, k, 'WRONGTYPE the window ' .. (want == 'hash' and 'counts' or 'leaders') .. ' key holds a ' .. kind}
    end
  end
  local floors = {}
  for k = first, #keys, 2 do
    local counts = keys[k]
    local raw = redis.call('HGET', counts, 'floor')
    local floor = tonumber(raw or '1')
    if not floor or floor % 1 ~= 0 then
      return {4, fence, k, "ERR the window's floor field holds '" .. raw .. "', not an integer"}
    end
    floors[k] = floor
  end
  return nil, floors
end

-- Adds the window deltas, keeps each window's leaders and sets the expiry.
-- Every count is added first, each under pcall: a field that holds no
-- integer (or would overflow) takes back the counts added before it and
-- returns {i, error, member} for its window's counts KEYS[i], so the caller
-- can take back its own writes and refuse the call whole. Only then are the
-- leaders kept, which cannot fail on keys of the right type. Returns nil
-- when every write was made.
local function apply_windows(keys, argv, at, w, floors)
  local pcall, kind = redis.pcall, type
  local first = #keys - 2 * w + 1
  local counted, c = {}, 0
  local a = at
  for k = first, #keys, 2 do
    local counts, runs = keys[k], tonumber(argv[a + 1])
    a = a + 2
    for _ = 1, runs do
      local delta, n = argv[a], tonumber(argv[a + 1])
      a = a + 2
      for _ = 1, n do
        local member = argv[a]
        local count = pcall('HINCRBY', counts, member, delta)
        if kind(count) == 'table' then
          undo_windows(keys, argv, at, first, a)
          return {k, count.err, member}
        end
        c = c + 1
        counted[c] = count
        a = a + 1
      end
    end
  end
  c = 0
  for k = first, #keys, 2 do
    local counts, leaders = keys[k], keys[k + 1]
    local expire_at, runs = argv[at], tonumber(argv[at + 1])
    local floor = floors[k]
    local moved, m, left, l = {}, 0, {}, 0
    at = at + 2
    for _ = 1, runs do
      local delta, n = tonumber(argv[at]), tonumber(argv[at + 1])
      at = at + 2
      for _ = 1, n do
        local member = argv[at]
        c = c + 1
        local count = counted[c]
        if count == 0 then
          redis.call('HDEL', counts, member)
        end
        if count >= floor then
          moved[m + 1], moved[m + 2] = count, member
          m = m + 2
        elseif count - delta >= floor then
          l = l + 1
          left[l] = member
        end
        at = at + 1
      end
    end
    call_chunked('ZADD', leaders, moved, m, 2 * ZSET_CHUNK)
    call_chunked('ZREM', leaders, left, l, ZSET_CHUNK)
    if redis.call('ZCARD', leaders) > LEADERS_CAP then
      local kept = redis.call('ZREVRANGE', leaders, LEADERS_KEEP - 1, LEADERS_KEEP - 1, 'WITHSCORES')
      local raised = tonumber(kept[2])
      if raised > floor then
        redis.call('ZREMRANGEBYSCORE', leaders, '-inf', '(' .. raised)
        redis.call('HSET', counts, 'floor', raised)
      end
    end
    redis.call('PEXPIREAT', counts, expire_at)
    redis.call('PEXPIREAT', leaders, expire_at)
  end
  return nil
end
