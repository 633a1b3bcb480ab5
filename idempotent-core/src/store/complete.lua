-- complete: store the outcome and mark the operation done, if the caller still owns it.
--
-- KEYS[1]  the operation's record (layout in acquire.lua)
-- ARGV[1]  owner token
-- ARGV[2]  encoded result
-- ARGV[3]  retention in milliseconds
--
-- The record becomes 'D' .. fingerprint .. token .. result, with the retention as its TTL.
--
-- Replies: 1 done (also when this token already completed it: a retry after a lost reply);
--          0 the token no longer owns the key (lease lost)
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'GET', key)
if not ok or not rec or #rec < 97 or string.sub(rec, 66, 97) ~= ARGV[1] then
  return 0
end
local state = string.byte(rec, 1)
if state == 68 then
  return 1
end
if (state ~= 82 and state ~= 78) or #rec ~= 143 then
  return 0
end
redis.call('SET', key, 'D' .. string.sub(rec, 2, 97) .. ARGV[2], 'PX', ARGV[3])
return 1
