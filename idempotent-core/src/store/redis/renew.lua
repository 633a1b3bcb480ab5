-- renew: move the lease deadline, if the caller still owns the key.
--
-- KEYS[1]  the operation's record (layout in layout.lua)
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
--
-- Replies: 1 renewed; 0 the token no longer owns the key (lease lost)
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'GET', key)
if not ok or not rec or #rec ~= RUNNING_LEN or string.sub(rec, TOKEN_FROM, TOKEN_TO) ~= ARGV[1] then
  return 0
end
local state = string.sub(rec, STATE, STATE)
-- SETRANGE counts from 0.
if state == NEW then
  -- A new record (written by SET NX) gets its deadline on the server's clock from now on.
  redis.call('SETRANGE', key, STATE - 1, RUNNING)
elseif state ~= RUNNING then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_ms = tonumber(ARGV[2])
redis.call('SETRANGE', key, LEASE_FROM - 1, string.format(LEASE_FORMAT, now + lease_ms))
if redis.call('PTTL', key) < lease_ms then
  redis.call('PEXPIRE', key, lease_ms)
end
return 1
