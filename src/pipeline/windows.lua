-- windows.lua: the window section both apply scripts take after their
-- counters (see src/domain/windows.rs); this text is put before each script.
--
-- ARGV[4]            W, the number of windows written, the last 2W keys of KEYS
-- KEYS[#KEYS-2W+1..] for each window, in pairs: its counts, the hash
--                    <prefix>:win:<size>:<start>[:{tag}] (field: the post as
--                    8 big-endian bytes, value: its net likes; field "floor":
--                    the leaders' floor, 1 when absent), then its leaders,
--                    the sorted set <prefix>:top:<size>:<start>[:{tag}]
-- ARGV[at..]         after the counters' arguments, for each window in KEYS
--                    order: expire_at (ms since the epoch), m, then m pairs
--                    (member, delta)
--
-- The leaders hold exactly the posts whose count is at least the floor,
-- each scored with its count. A write keeps that true: a count that reaches
-- the floor enters or moves in the leaders, one that falls below it leaves.
-- When the leaders pass LEADERS_CAP members, the floor rises to the count
-- of the LEADERS_KEEP-th and every post below it leaves them, so the sorted
-- set (each write to it a walk of its skiplist) stays small while every
-- post's count stays in the hash.
--
-- Every key is checked before the script's first write: one of another type,
-- or a floor that is not an integer, is refused like a bad counter. A post's
-- count that is not an integer is found by its HINCRBY, which the script
-- takes back with everything else it added, so no call is kept half-way. A
-- count brought to 0 is removed (absent reads as 0), and PEXPIREAT with a
-- time already past deletes both keys: a write to an expired window keeps
-- nothing.

local LEADERS_CAP, LEADERS_KEEP = 4000, 2000

-- Whether argv[at..] holds whole pairs for each of the w windows, to its end.
local function windows_shaped(argv, at, w)
  for _ = 1, w do
    local m = tonumber(argv[at + 1])
    if not tonumber(argv[at]) or not m or m < 0 or m % 1 ~= 0 then
      return false
    end
    at = at + 2 + 2 * m
  end
  return at == #argv + 1
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
  for _, call in ipairs({{'HINCRBY', counts, 'm', '1'}, {'HDEL', counts, 'm'}, {'HGET', counts, 'm'}, {'HSET', counts, 'm', '1'},
      {'ZADD', leaders, '1', 'm'}, {'ZREM', leaders, 'm'}, {'ZCARD', leaders}, {'ZREVRANGE', leaders, '0', '0'},
      {'ZREMRANGEBYSCORE', leaders, '0', '0'}, {'PEXPIREAT', counts, '0'}, {'TYPE', counts}}) do
    if not redis.acl_check_cmd(unpack(call)) then
      return redis.error_reply("NOPERM this user has no permissions to run the '" .. string.lower(call[1]) .. "' command")
    end
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
  local counted = {}
  local a = at
  for k = first, #keys, 2 do
    local counts, m = keys[k], tonumber(argv[a + 1])
    a = a + 2
    for _ = 1, m do
      local member, delta = argv[a], argv[a + 1]
      local count = pcall('HINCRBY', counts, member, delta)
      if kind(count) == 'table' then
        -- Back over every count added so far, in every window before this one.
        local b = at
        for j = first, k, 2 do
          local n = tonumber(argv[b + 1])
          b = b + 2
          for _ = 1, n do
            if b == a then
              break
            end
            if redis.call('HINCRBY', keys[j], argv[b], -tonumber(argv[b + 1])) == 0 then
              redis.call('HDEL', keys[j], argv[b])
            end
            b = b + 2
          end
        end
        return {k, count.err, member}
      end
      counted[#counted + 1] = count
      a = a + 2
    end
  end
  local c = 0
  for k = first, #keys, 2 do
    local counts, leaders = keys[k], keys[k + 1]
    local expire_at, m = argv[at], tonumber(argv[at + 1])
    local floor = floors[k]
    at = at + 2
    for _ = 1, m do
      local member, delta = argv[at], argv[at + 1]
      c = c + 1
      local count = counted[c]
      if count == 0 then
        redis.call('HDEL', counts, member)
      end
      if count >= floor then
        redis.call('ZADD', leaders, count, member)
      elseif count - delta >= floor then
        redis.call('ZREM', leaders, member)
      end
      at = at + 2
    end
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
