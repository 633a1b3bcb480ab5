-- release: give the key up without an outcome, keeping the fence, if the caller still owns it.
--
-- KEYS[1]  the operation's record (see acquire.lua)
-- ARGV[1]  owner token
--
-- Replies: 1 released (also when this token already released it: a retry after a lost reply);
--          0 the token no longer owns the key (lease lost)
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'HMGET', key, 'st', 'tok')
if ok and rec[1] == 'released' and rec[2] == ARGV[1] then
  return 1
end
if not ok or rec[1] ~= 'running' or rec[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', key, 'st', 'released')
redis.call('HDEL', key, 'lease')
return 1
