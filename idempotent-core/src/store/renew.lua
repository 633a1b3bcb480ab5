-- renew: move the lease deadline, if the caller still owns the key.
--
-- KEYS[1]  the operation's record (layout in acquire.lua)
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
--
-- Replies: 1 renewed; 0 the token no longer owns the key (lease lost)
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'GET', key)
if not ok or not rec or #rec ~= 143 or string.sub(rec, 66, 97) ~= ARGV[1] then
  return 0
end
local state = string.byte(rec, 1)
if state == 78 then
  -- A new record (written by SET NX) gets its deadline on the server's clock from now on.
  redis.call('SETRANGE', key, 0, 'R')
elseif state ~= 82 then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_ms = tonumber(ARGV[2])
redis.call('SETRANGE', key, 97, string.format('%015.0f', now + lease_ms))
if redis.call('PTTL', key) < lease_ms then
  redis.call('PEXPIRE', key, lease_ms)
end
return 1
