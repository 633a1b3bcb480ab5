-- read: a record as an operator sees it (inspect, scan), without its result; changes nothing.
--
-- KEYS[1]  the operation's record (layout in layout.lua)
--
-- Replies
--   0                                     no record
--   {now, pttl, head, result_len}         the server's clock (ms), the key's PTTL (-1: no TTL),
--                                         the record up to its result (the whole record but for
--                                         a done one) and the result's length
--   error IDEMPOTENT_CORRUPT ...          the key holds something these scripts did not write
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'GET', key)
if not ok then
  return redis.error_reply('IDEMPOTENT_CORRUPT the key holds another type than a string')
end
if not rec then
  return 0
end
local from = result_from(rec)
if from then
  return {now_ms(), redis.call('PTTL', key), string.sub(rec, 1, from - 1), #rec - from + 1}
end
if not is_running(rec) then
  return redis.error_reply('IDEMPOTENT_CORRUPT the key holds a string that is not a record')
end
return {now_ms(), redis.call('PTTL', key), rec, 0}
