-- abandon: end the caller's attempt without an outcome, if it still owns the key, leaving the
-- record released-uncertain (the next acquisition is recovered) or needing attention.
--
-- KEYS[1]  the operation's record (layout in layout.lua)
-- ARGV[1]  owner token
-- ARGV[2]  the state the record goes to: RELEASED (X, uncertain: its recovered byte becomes 1;
--          the TTL is kept, as release keeps it) or NEEDS_ATTENTION (A: the TTL is removed, the
--          record waits to be resolved). Fingerprint, token, fence, attempt, labels and
--          creation time are kept; the update time becomes now.
--
-- Replies: 1 done (also when this token already left the record so: a retry after a lost
--          reply); 0 the token no longer owns the key, or the record is in another state (done,
--          released clean, marked the other way)
local key, mark = KEYS[1], ARGV[2]
if mark ~= RELEASED and mark ~= NEEDS_ATTENTION then
  return redis.error_reply('IDEMPOTENT_CORRUPT arguments: the mark is neither X (uncertain) nor A (needs attention)')
end
local ok, rec = pcall(redis.call, 'GET', key)
if not ok or not rec or not is_running(rec) or string.sub(rec, TOKEN_FROM, TOKEN_TO) ~= ARGV[1] then
  return 0
end
local state = string.sub(rec, STATE, STATE)
if state == mark then
  -- Released clean is not released uncertain.
  if mark == NEEDS_ATTENTION or string.sub(rec, RECOVERED, RECOVERED) == '1' then
    -- Written again as it is (TTL kept), so that the repeat replicates like the first write: a
    -- WAIT behind it then covers the mark whichever connection the first one went out on.
    redis.call('SET', key, rec, 'KEEPTTL')
    return 1
  end
  return 0
end
if state ~= RUNNING and state ~= NEW then
  return 0
end
-- SETRANGE counts from 0.
redis.call('SETRANGE', key, STATE - 1, mark)
redis.call('SETRANGE', key, UPDATED_FROM - 1, string.format(TIME_FORMAT, now_ms()))
if mark == RELEASED then
  redis.call('SETRANGE', key, RECOVERED - 1, '1')
else
  redis.call('PERSIST', key)
end
return 1
