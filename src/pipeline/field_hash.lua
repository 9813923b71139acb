-- field_hash.lua: the hash that places a field of a growing packed generation
-- in its slot group's hashes, and the addresses it gives; put before
-- apply_packed.lua. The same as field_hash and Splits in
-- src/domain/packing.rs, held to the same vectors by tests/apply_growing.rs.
--
-- field_hash(field)        FNV-1a (32 bits) of the field's bytes, then
--                          MurmurHash3's 32-bit finaliser, as a number in
--                          [0, 2^32). Every product stays below 2^53, so
--                          Lua's doubles hold it exactly.
-- level_of(n, level, nxt)  the level of hash n under the split state
--                          (level, nxt), nil when the group has no hash n

local TWO32 = 4294967296
local bxor, rshift = bit.bxor, bit.rshift

-- a * b mod 2^32, for a and b in [0, 2^32).
local function mul32(a, b)
  local alo, blo = a % 65536, b % 65536
  local ahi, bhi = (a - alo) / 65536, (b - blo) / 65536
  return (alo * blo + ((ahi * blo + alo * bhi) % 65536) * 65536) % TWO32
end

local function field_hash(field)
  local h = 2166136261
  for i = 1, #field do
    h = bxor(h, string.byte(field, i)) % TWO32
    -- h * 16777619 = h * 2^24 + h * 403, mod 2^32
    h = ((h % 256) * 16777216 + h * 403) % TWO32
  end
  h = bxor(h, rshift(h, 16)) % TWO32
  h = mul32(h, 2246822507)
  h = bxor(h, rshift(h, 13)) % TWO32
  h = mul32(h, 3266489909)
  return bxor(h, rshift(h, 16)) % TWO32
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
