-- field_hash.lua: the hash that places a field of a growing packed generation
-- in its slot group's hashes, and the addresses it gives; put before
-- apply_packed.lua. The same as field_hash and Splits in
-- src/domain/packing.rs, held to the same vectors by tests/apply_growing.rs.
--
-- field_hash(field)        the field's bytes read as a number in base
--                          1000003, modulo the prime 2^31 - 1: every product
--                          stays below 2^51, so Lua's doubles hold it
--                          exactly, and no bit operation is needed (a call
--                          to the bit library costs more than the arithmetic)
-- level_of(n, level, nxt)  the level of hash n under the split state
--                          (level, nxt), nil when the group has no hash n

local byte = string.byte

local function field_hash(field)
  local h, n, i = 0, #field, 1
  -- Four bytes a call of string.byte.
  while i <= n - 3 do
    local a, b, c, d = byte(field, i, i + 3)
    h = (h * 1000003 + a) % 2147483647
    h = (h * 1000003 + b) % 2147483647
    h = (h * 1000003 + c) % 2147483647
    h = (h * 1000003 + d) % 2147483647
    i = i + 4
  end
  while i <= n do
    h = (h * 1000003 + byte(field, i)) % 2147483647
    i = i + 1
  end
  return h
end

local function level_of(n, level, nxt)
  local size = 2 ^ level
  if n >= size + nxt then
    return nil
  end
  if n < nxt or n >= size then
    return level + 1
  end
  return level
end
