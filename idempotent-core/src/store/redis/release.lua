-- release: give the key up without an outcome, keeping the fence, if the caller still owns it.
--
-- KEYS[1]  the operation's record (layout in layout.lua)
-- ARGV[1]  owner token
--
-- Replies: 1 released (also when this token already released it: a retry after a lost reply);
--          0 the token no longer owns the key (lease lost)
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'GET', key)
if not ok or not rec or #rec ~= RUNNING_LEN or string.sub(rec, TOKEN_FROM, TOKEN_TO) ~= ARGV[1] then
  return 0
end
local state = string.sub(rec, STATE, STATE)
if state == RELEASED then
  return 1
end
if state ~= RUNNING and state ~= NEW then
  return 0
end
-- SETRANGE counts from 0.
redis.call('SETRANGE', key, STATE - 1, RELEASED)
return 1
