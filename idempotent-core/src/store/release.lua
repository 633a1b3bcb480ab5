-- release: give the key up without an outcome, keeping the fence, if the caller still owns it.
--
-- KEYS[1]  the operation's record (layout in acquire.lua)
-- ARGV[1]  owner token
--
-- Replies: 1 released (also when this token already released it: a retry after a lost reply);
--          0 the token no longer owns the key (lease lost)
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'GET', key)
if not ok or not rec or #rec ~= 143 or string.sub(rec, 66, 97) ~= ARGV[1] then
  return 0
end
local state = string.byte(rec, 1)
if state == 88 then
  return 1
end
if state ~= 82 and state ~= 78 then
  return 0
end
redis.call('SETRANGE', key, 0, 'X')
return 1
