-- renew: move the lease deadline, if the caller still owns the key.
--
-- KEYS[1]  the operation's record (layout in layout.lua)
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
--
-- The update time becomes now; labels and creation time are kept.
--
-- Replies: 1 renewed; 0 the token no longer owns the key (lease lost)
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'GET', key)
if not ok or not rec or not is_running(rec) or string.sub(rec, TOKEN_FROM, TOKEN_TO) ~= ARGV[1] then
  return 0
end
local state = string.sub(rec, STATE, STATE)
if state ~= RUNNING and state ~= NEW then
  return 0
end
-- SETRANGE counts from 0.
if state == NEW then
  -- A new record (written by SET NX) gets its deadline on the server's clock from now on.
  redis.call('SETRANGE', key, STATE - 1, RUNNING)
end
local now = now_ms()
local lease_ms = tonumber(ARGV[2])
redis.call('SETRANGE', key, LEASE_FROM - 1, string.format(LEASE_FORMAT, now + lease_ms))
redis.call('SETRANGE', key, UPDATED_FROM - 1, string.format(TIME_FORMAT, now))
if redis.call('PTTL', key) < lease_ms then
  redis.call('PEXPIRE', key, lease_ms)
end
return 1
