-- release_fenced: take the key from whichever attempt holds it, if that attempt's fence is the
-- one given, leaving the record released uncertain (the next acquisition is recovered).
--
-- KEYS[1]  the operation's record (layout in layout.lua)
-- ARGV[1]  the fence, in digits
--
-- A running record (R or N, its lease live or passed) with that fence becomes X with the
-- recovered byte 1; its fingerprint, token, fence, attempt, labels, creation time and TTL are
-- kept, the update time becomes now. The holder's token then completes, renews and releases
-- nothing.
--
-- Replies
--   1                               released
--   0                               no record, another fence, or not running
--   error IDEMPOTENT_CORRUPT ...    the key holds something these scripts did not write
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'GET', key)
if not ok then
  return redis.error_reply('IDEMPOTENT_CORRUPT the key holds another type than a string')
end
if not rec or result_from(rec) then
  return 0
end
if not is_running(rec) then
  return redis.error_reply('IDEMPOTENT_CORRUPT the key holds a string that is not a record')
end
local state = string.sub(rec, STATE, STATE)
local fence = string.sub(rec, FENCE_FROM, FENCE_TO)
if not string.find(fence, '^%d+$') then
  return redis.error_reply('IDEMPOTENT_CORRUPT the record has a malformed number')
end
if (state ~= RUNNING and state ~= NEW) or tonumber(fence) ~= tonumber(ARGV[1]) then
  return 0
end
-- SETRANGE counts from 0.
redis.call('SETRANGE', key, STATE - 1, RELEASED)
redis.call('SETRANGE', key, RECOVERED - 1, '1')
redis.call('SETRANGE', key, UPDATED_FROM - 1, string.format(TIME_FORMAT, now_ms()))
return 1
