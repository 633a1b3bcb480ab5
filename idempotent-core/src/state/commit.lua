-- state commit: store a new value if the state is at the expected version and this commit's
-- token was not applied yet.
--
-- KEYS[1]  the state's hash:
--            v          the version (absent: the state is absent, version 0)
--            d          the value
--            t:<token>  the version the commit with <token> produced, for the last ARGV[4] commits
--            s:<n>      the token of the commit that produced a version = n (mod ARGV[4]), so
--                       that the oldest token is dropped as a new one comes in
-- ARGV[1]  the expected version, in decimal
-- ARGV[2]  the commit token, in hex
-- ARGV[3]  the new value
-- ARGV[4]  how many commit tokens to keep (COMMIT_HISTORY)
--
-- Replies: {1, version}        committed, as version
--          {2, version}        this token's commit was applied already and produced version
--          {0, version, value} the state is at version (value false while absent): conflict
local key = KEYS[1]
local done = redis.call('HGET', key, 't:' .. ARGV[2])
if done then
  return {2, tonumber(done)}
end
local v = tonumber(redis.call('HGET', key, 'v') or '0')
if v ~= tonumber(ARGV[1]) then
  return {0, v, redis.call('HGET', key, 'd') or false}
end
local nv = v + 1
local nvs = string.format('%d', nv)
local slot = 's:' .. string.format('%d', nv % tonumber(ARGV[4]))
local old = redis.call('HGET', key, slot)
if old then
  redis.call('HDEL', key, 't:' .. old)
end
redis.call('HSET', key, 'v', nvs, 'd', ARGV[3], 't:' .. ARGV[2], nvs, slot, ARGV[2])
return {1, nv}
