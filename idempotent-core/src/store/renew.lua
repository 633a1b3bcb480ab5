-- renew: move the lease deadline to ARGV[2] ms from now (server time), if the caller owns the key.
--
-- KEYS[1]  the operation's record (see acquire.lua)
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
--
-- Replies: 1 renewed; 0 the token no longer owns the key (lease lost)
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'HMGET', key, 'st', 'tok')
if not ok or rec[1] ~= 'running' or rec[2] ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_ms = tonumber(ARGV[2])
redis.call('HSET', key, 'lease', string.format('%.0f', now + lease_ms))
if redis.call('PTTL', key) < lease_ms then
  redis.call('PEXPIRE', key, lease_ms)
end
return 1
