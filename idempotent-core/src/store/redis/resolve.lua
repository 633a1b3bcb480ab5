-- resolve: settle a record that needs attention; any other record is left as it is.
--
-- KEYS[1]  the operation's record (layout in layout.lua)
-- ARGV[1]  the state the record goes to: DONE (the action ran: ARGV[3] is its encoded outcome,
--          replayed from now on) or RELEASED (it did not: the next acquisition runs it, not
--          recovered, with the next attempt number and a higher fence)
-- ARGV[2]  the new TTL in milliseconds (the retention, or how long a released record is kept)
-- ARGV[3]  DONE: the encoded outcome
--
-- The record keeps its fingerprint, token, fence, attempt, labels and creation time; the update
-- time becomes now.
--
-- Replies
--   1                               resolved
--   0                               the key is absent, or its record does not need attention
--                                   (running, released, done; perhaps resolved already)
--   error IDEMPOTENT_CORRUPT ...    the key holds something these scripts did not write
local key, to = KEYS[1], ARGV[1]
if not ((to == DONE and #ARGV == 3) or (to == RELEASED and #ARGV == 2)) then
  return redis.error_reply('IDEMPOTENT_CORRUPT arguments: expected D, a TTL and an outcome, or X and a TTL')
end
local ok, rec = pcall(redis.call, 'GET', key)
if not ok then
  return redis.error_reply('IDEMPOTENT_CORRUPT the key holds another type than a string')
end
if not rec then
  return 0
end
local state = string.sub(rec, STATE, STATE)
if state == DONE and result_from(rec) then
  return 0
end
if not is_running(rec) then
  return redis.error_reply('IDEMPOTENT_CORRUPT the key holds a string that is not a record')
end
-- Digits only, as acquire reads them.
for _, field in ipairs({{LEASE_FROM, LEASE_TO}, {FENCE_FROM, FENCE_TO}, {ATTEMPT_FROM, ATTEMPT_TO}}) do
  if not string.find(string.sub(rec, field[1], field[2]), '^%d+$') then
    return redis.error_reply('IDEMPOTENT_CORRUPT the record has a malformed number')
  end
end
if tonumber(string.sub(rec, FENCE_FROM, FENCE_TO)) >= MAX_FENCE then
  return redis.error_reply('IDEMPOTENT_CORRUPT the record has a fence beyond 2^53')
end
if state ~= NEEDS_ATTENTION then
  return 0
end
local times = string.sub(rec, CREATED_FROM, CREATED_TO) .. string.format(TIME_FORMAT, now_ms())
if to == DONE then
  redis.call('SET', key, DONE .. string.sub(rec, FINGERPRINT_FROM, RECOVERED) .. times .. string.sub(rec, STEP_LEN_FROM) .. ARGV[3], 'PX', ARGV[2])
else
  -- Released clean: the recovered byte 0.
  redis.call('SET', key, RELEASED .. string.sub(rec, FINGERPRINT_FROM, ATTEMPT_TO) .. '0' .. times .. string.sub(rec, STEP_LEN_FROM), 'PX', ARGV[2])
end
return 1
