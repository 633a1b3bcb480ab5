-- release: give the key up without an outcome, keeping the fence, if the caller still owns it.
--
-- KEYS[1]  the operation's record (layout in layout.lua)
-- ARGV[1]  owner token
-- ARGV[2]  (optional) '1': the release of a key a failed acquire may have taken, which keeps the
--          record's recovered byte (an acquisition that took over an uncertain or expired record
--          leaves it uncertain; a fresh one leaves it clean)
--
-- The TTL, labels and creation time are kept; the update time becomes now.
--
-- Replies: 1 released (also when this token already released it: a retry after a lost reply);
--          0 the token no longer owns the key (lease lost), or the record is in another state
--          (done, released uncertain, needing attention)
local key = KEYS[1]
local orphan = ARGV[2] == '1'
local ok, rec = pcall(redis.call, 'GET', key)
if not ok or not rec or not is_running(rec) or string.sub(rec, TOKEN_FROM, TOKEN_TO) ~= ARGV[1] then
  return 0
end
local state = string.sub(rec, STATE, STATE)
if state == RELEASED then
  -- Released clean by this token; released uncertain (abandon) is another transition.
  return string.sub(rec, RECOVERED, RECOVERED) == '0' and 1 or 0
end
if state ~= RUNNING and state ~= NEW then
  return 0
end
-- SETRANGE counts from 0.
redis.call('SETRANGE', key, STATE - 1, RELEASED)
redis.call('SETRANGE', key, UPDATED_FROM - 1, string.format(TIME_FORMAT, now_ms()))
if not orphan then
  -- Released clean: the recovered byte 0 (the next acquisition is not recovered).
  redis.call('SETRANGE', key, RECOVERED - 1, '0')
end
return 1
