-- complete: store the outcome and mark the operation done, if the caller still owns it.
--
-- KEYS[1]  the operation's record (see acquire.lua)
-- ARGV[1]  owner token
-- ARGV[2]  encoded result
-- ARGV[3]  retention in milliseconds
--
-- Replies: 1 done (also when this token already completed it: a retry after a lost reply);
--          0 the token no longer owns the key (lease lost)
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'HMGET', key, 'st', 'tok')
if ok and rec[1] == 'done' and rec[2] == ARGV[1] then
  return 1
end
if not ok or rec[1] ~= 'running' or rec[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', key, 'st', 'done', 'res', ARGV[2])
redis.call('HDEL', key, 'lease')
redis.call('PEXPIRE', key, ARGV[3])
return 1
