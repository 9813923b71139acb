-- acl_check.lua: the start of every tally script that writes more than once.
--
-- Redis checks the commands a script calls against the caller's ACL only as
-- they run, and its refusal names no command. A script therefore calls
-- acl_refusal with every command it may call before its first write: a
-- missing permission then writes nothing, and the error names it.
--
-- acl_refusal(calls)  calls: a list of {COMMAND, arg, ...}, each as the
--                     script would call it
-- Returns a NOPERM error reply naming the first command refused, or nil.

local function acl_refusal(calls)
  for _, call in ipairs(calls) do
    if not redis.acl_check_cmd(unpack(call)) then
      return redis.error_reply("NOPERM this user has no permissions to run the '" .. string.lower(call[1]) .. "' command")
    end
  end
  return nil
end

