-- windows.lua: the window section both apply scripts take after their
-- counters (see src/domain/windows.rs); this text is put before each script.
--
-- ARGV[4]            W, the number of window sets, the last W keys of KEYS
-- KEYS[#KEYS-W+1..]  the sets <prefix>:win:<size>:<start>[:{tag}]
-- ARGV[at..]         after the counters' arguments, for each set in KEYS
--                    order: expire_at (ms since the epoch), m, then m pairs
--                    (member, delta)
--
-- Every set is checked before the script's first write: a key of another
-- type is refused like a bad counter, so that ZINCRBY cannot fail half-way.
-- A member brought to 0 is removed (absent reads as 0), and PEXPIREAT with a
-- time already past deletes the set: a write to an expired window keeps
-- nothing.

-- Whether argv[at..] holds whole pairs for each of the w sets, to its end.
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
-- set KEYS[i] of another type, or nil.
local function windows_refusal(keys, w, fence)
  if w == 0 then
    return nil
  end
  local first = #keys - w + 1
  for _, call in ipairs({{'ZINCRBY', keys[first], '1', 'm'}, {'ZREM', keys[first], 'm'}, {'PEXPIREAT', keys[first], '0'}, {'TYPE', keys[first]}}) do
    if not redis.acl_check_cmd(unpack(call)) then
      return redis.error_reply("NOPERM this user has no permissions to run the '" .. string.lower(call[1]) .. "' command")
    end
  end
  for k = first, #keys do
    local kind = redis.call('TYPE', keys[k]).ok
    if kind ~= 'zset' and kind ~= 'none' then
      return {4, fence, k, 'WRONGTYPE the window set holds a ' .. kind}
    end
  end
  return nil
end

-- Adds the window deltas and sets each set's expiry.
local function apply_windows(keys, argv, at, w)
  for k = #keys - w + 1, #keys do
    local key, expire_at, m = keys[k], argv[at], tonumber(argv[at + 1])
    at = at + 2
    for _ = 1, m do
      local member = argv[at]
      if tonumber(redis.call('ZINCRBY', key, argv[at + 1], member)) == 0 then
        redis.call('ZREM', key, member)
      end
      at = at + 2
    end
    redis.call('PEXPIREAT', key, expire_at)
  end
end

