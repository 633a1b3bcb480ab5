-- delete: remove the record, unless an attempt holds a live lease on it.
--
-- KEYS[1]  the operation's record (layout in layout.lua)
--
-- The next acquisition starts afresh (attempt 1); its fence is still above this record's, as
-- acquire never takes a fence below the server's clock in microseconds.
--
-- Replies
--   1                               deleted
--   0                               no record
--   2                               an attempt holds a live lease: nothing changed
--   error IDEMPOTENT_CORRUPT ...    the key holds something these scripts did not write
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'GET', key)
if not ok then
  return redis.error_reply('IDEMPOTENT_CORRUPT the key holds another type than a string')
end
if not rec then
  return 0
end
if not result_from(rec) then
  if not is_running(rec) then
    return redis.error_reply('IDEMPOTENT_CORRUPT the key holds a string that is not a record')
  end
  local state = string.sub(rec, STATE, STATE)
  local lease_s = string.sub(rec, LEASE_FROM, LEASE_TO)
  if not string.find(lease_s, '^%d+$') then
    return redis.error_reply('IDEMPOTENT_CORRUPT the record has a malformed number')
  end
  -- A lease is live as acquire judges it: an R record by its deadline, an N one by its TTL.
  if state == RUNNING and tonumber(lease_s) > now_ms() then
    return 2
  end
  if state == NEW and redis.call('PTTL', key) > tonumber(lease_s) then
    return 2
  end
end
redis.call('DEL', key)
return 1
