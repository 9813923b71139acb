-- apply_fence.lua: the fence check both apply scripts start with; this text
-- is put before each of them (after acl_check.lua).
--
-- fence_decision()  KEYS[1] the group's fence key; ARGV[1] start, ARGV[2]
--                   last, the range the call covers; ARGV[3] the fence to
--                   assume when the key is absent (the partition's origin - 1)
-- Returns the fence and nil when the range is the one that follows it (the
-- call applies), the fence and the code of a range that is not applied
-- (1 duplicate: fence >= last; 2 straddle: start <= fence < last; 3 gap:
-- fence + 1 < start), or nil and an error reply when the key holds what is
-- not an offset. The codes are the decision table of src/domain/fence.rs.

local function fence_decision()
  local raw = redis.call('GET', KEYS[1])
  local fence = tonumber(raw or ARGV[3])
  if not fence or fence % 1 ~= 0 then
    -- Not a value the scripts write: what the fence said is lost.
    return nil, redis.error_reply('ERR ' .. KEYS[1] .. ' holds "' .. tostring(raw) .. '", which is not an offset and not a value tally writes; the position it kept is lost: restore the key from a backup of this store, or recount the prefix with `tally rebuild`')
  end
  local start, last = tonumber(ARGV[1]), tonumber(ARGV[2])
  if fence >= last then
    return fence, 1
  end
  if fence + 1 < start then
    return fence, 3
  end
  if fence + 1 > start then
    return fence, 2
  end
  return fence, nil
end

