-- acquire: take the operation's key, or say why not.
--
-- KEYS[1]  the operation's record, a hash with fields
--          st (running | done | released), fp, tok (owner token of the last acquisition),
--          lease (ms, server time), fence, att, rcv (recovered flag), res
-- ARGV[1]  payload fingerprint (hex)
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  new owner token (a retry of an acquire whose reply was lost sends the same token and
--          gets the same answer: acquire is idempotent per token)
-- ARGV[4]  retention in milliseconds (the record's TTL is max(lease, retention))
--
-- Replies
--   {1, fence, attempt, recovered}  acquired (recovered = 1 when a previous lease ran out)
--   {2, result}                     done: replay the stored result
--   {3, retry_after_ms}             another owner's lease is live
--   {4}                             the record has another fingerprint
--   error IDEMPOTENT_CORRUPT ...    the key holds something this script did not write
local key = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])

local ok, rec = pcall(redis.call, 'HMGET', key, 'st', 'fp', 'lease', 'fence', 'att', 'res', 'tok', 'rcv')
if not ok then
  return redis.error_reply('IDEMPOTENT_CORRUPT key is not a hash')
end
local st = rec[1]
local recovered = 0
if st and rec[7] == ARGV[3] then
  -- This token already acquired the key: a retry, or a late duplicate, of an acquire whose reply
  -- was lost. Answer as then, and change nothing.
  if st == 'done' then
    return {2, rec[6]}
  end
  return {1, tonumber(rec[4]), tonumber(rec[5]), tonumber(rec[8]) or 0}
end
if st then
  if rec[2] ~= ARGV[1] then
    return {4}
  end
  if st == 'done' then
    if not rec[6] then
      return redis.error_reply('IDEMPOTENT_CORRUPT done record without a result')
    end
    return {2, rec[6]}
  elseif st == 'running' then
    local lease = tonumber(rec[3])
    if not lease then
      return redis.error_reply('IDEMPOTENT_CORRUPT running record without a lease')
    end
    if lease > now then
      return {3, lease - now}
    end
    recovered = 1
  elseif st ~= 'released' then
    return redis.error_reply('IDEMPOTENT_CORRUPT unknown state')
  end
end

-- Fences only grow: one more than the last, and never below the server's clock in microseconds,
-- so a record that was lost (expired, flushed) still gets a fence above every earlier one.
local fence = math.max((tonumber(rec[4]) or 0) + 1, now_us)
local attempt = (tonumber(rec[5]) or 0) + 1
local lease_ms = tonumber(ARGV[2])
redis.call('HSET', key,
  'st', 'running', 'fp', ARGV[1], 'tok', ARGV[3],
  'lease', string.format('%.0f', now + lease_ms),
  'fence', string.format('%.0f', fence),
  'att', string.format('%.0f', attempt),
  'rcv', recovered)
redis.call('HDEL', key, 'res')
redis.call('PEXPIRE', key, math.max(lease_ms, tonumber(ARGV[4])))
return {1, fence, attempt, recovered}
