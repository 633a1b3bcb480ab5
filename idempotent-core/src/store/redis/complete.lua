-- complete: store the outcome and mark the operation done, if the caller still owns it.
--
-- KEYS[1]  the operation's record (layout in layout.lua)
-- ARGV[1]  owner token
-- ARGV[2]  encoded result
-- ARGV[3]  retention in milliseconds
-- ARGV[4]  the update time: the client's estimate of the server's clock in milliseconds, as many
--          digits as the record's times (see clock.rs), or empty to read the server's clock
--
-- The record becomes C: its fingerprint, token, fence, attempt, creation time and labels kept,
-- the update time now (never before the record's last change), then the result, with the
-- retention as its TTL.
--
-- Replies: 1 done (also when this token already completed it: a retry after a lost reply);
--          0 the token no longer owns the key (lease lost), or its attempt was released or
--          abandoned (a complete that lands after the mark is refused)
local key = KEYS[1]
local ok, rec = pcall(redis.call, 'GET', key)
if not ok or not rec or #rec < TOKEN_TO or string.sub(rec, TOKEN_FROM, TOKEN_TO) ~= ARGV[1] then
  return 0
end
local state = string.sub(rec, STATE, STATE)
if state == DONE then
  -- Written again as it is (TTL kept), so that the repeat replicates like the first write: a
  -- WAIT behind it then covers the outcome whichever connection the first one went out on.
  redis.call('SET', key, rec, 'KEEPTTL')
  return 1
end
if (state ~= RUNNING and state ~= NEW) or not is_running(rec) then
  return 0
end
local updated = ARGV[4] or ''
if #updated ~= UPDATED_TO - UPDATED_FROM + 1 then
  updated = string.format(TIME_FORMAT, now_ms())
end
-- Never before the record's last change (its creation, or a renewal by the server's clock):
-- both are digits zero-padded to the same width, so they compare as numbers.
local last = string.sub(rec, UPDATED_FROM, UPDATED_TO)
if updated < last then
  updated = last
end
redis.call('SET', key,
  DONE .. string.sub(rec, FINGERPRINT_FROM, CREATED_TO) .. updated .. string.sub(rec, STEP_LEN_FROM) .. ARGV[2],
  'PX', ARGV[3])
return 1
