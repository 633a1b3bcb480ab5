-- acquire: take the operation's key, or say why not.
--
-- The store tries a plain `SET key <N record> NX GET PX <ttl>` first: it takes an absent key
-- and returns any record that is there, so a replay and a first acquisition are one command
-- and no script. This script runs when that found a running or released record (or when the
-- server refuses that form of SET, before Redis 7.0); it also takes an absent key itself.
--
-- KEYS[1]  the operation's record, one string (positions 1-based, as string.sub counts):
--            1          state: R running, N new (running, written by SET NX), X released, D done
--            2-65       payload fingerprint, 64 hex characters
--            66-97      owner token of the last acquisition, 32 characters
--          R, N and X, 143 bytes in all:
--            98-112     R: lease deadline, milliseconds of server time, 15 digits
--                       N: the TTL in milliseconds at or below which the lease has passed (the
--                          record's TTL minus the lease, 15 digits): a SET cannot read the
--                          server's clock, so the lease of an N record is judged by its TTL
--                       X: unused
--            113-132    fence, 20 digits
--            133-142    attempt, 10 digits
--            143        recovered flag, 0 or 1
--          D:
--            98-        the encoded result (no fence is kept: nothing acquires a done key)
-- ARGV[1]  one argument of 126 bytes (one, because Redis hands every argument to Lua as a new
--          string):
--            1-64       payload fingerprint, 64 hex characters
--            65-96      new owner token, 32 characters (a retry of an acquire whose reply was
--                       lost sends the same token and gets the same answer: acquire is
--                       idempotent per token)
--            97-111     lease in milliseconds, 15 digits
--            112-126    retention in milliseconds, 15 digits (the record's TTL is
--                       max(lease, retention))
--
-- Replies
--   the whole record                done: the client compares the fingerprint (bytes 2-65) and
--                                   replays the result (98-), or answers Mismatch
--   {1, fence, attempt, recovered}  acquired (recovered = 1 when a previous lease ran out)
--   {3, retry_after_ms}             another owner's lease is live
--   {4}                             the record has another fingerprint
--   error IDEMPOTENT_CORRUPT ...    the key holds something these scripts did not write
local key, args = KEYS[1], ARGV[1]
if #args ~= 126 then
  return redis.error_reply('IDEMPOTENT_CORRUPT arguments: expected fingerprint (64), token (32), lease and retention (15 digits each)')
end
local ok, rec = pcall(redis.call, 'GET', key)
if not ok then
  return redis.error_reply('IDEMPOTENT_CORRUPT the key holds another type than a string')
end

local state, last_fence, last_attempt, lease = nil, 0, 0, nil
if rec then
  state = string.byte(rec, 1)
  if state == 68 then
    -- Done. (A retried acquire of the token that completed the key has the same fingerprint:
    -- it replays.)
    return rec
  end
  if #rec ~= 143 or (state ~= 82 and state ~= 78 and state ~= 88) then
    return redis.error_reply('IDEMPOTENT_CORRUPT the key holds a string that is not a record')
  end
  -- Digits only: Lua's tonumber would also take 'nan', 'inf', '0x..', '1e18' and signs. Fences
  -- stay below 2^53, where a double counts exactly.
  local lease_s, fence_s, attempt_s = string.sub(rec, 98, 112), string.sub(rec, 113, 132), string.sub(rec, 133, 142)
  if not (string.find(lease_s, '^%d+$') and string.find(fence_s, '^%d+$') and string.find(attempt_s, '^%d+$')) then
    return redis.error_reply('IDEMPOTENT_CORRUPT the record has a malformed number')
  end
  lease, last_fence, last_attempt = tonumber(lease_s), tonumber(fence_s), tonumber(attempt_s)
  if last_fence >= 9007199254740992 then
    return redis.error_reply('IDEMPOTENT_CORRUPT the record has a fence beyond 2^53')
  end
  -- This token already acquired the key: a retry, or a late duplicate, of an acquire whose
  -- reply was lost. Answer as then, and change nothing.
  if string.sub(rec, 66, 97) == string.sub(args, 65, 96) then
    return {1, last_fence, last_attempt, string.sub(rec, 143, 143) == '1' and 1 or 0}
  end
  if string.sub(rec, 2, 65) ~= string.sub(args, 1, 64) then
    return {4}
  end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local recovered = 0
if state == 82 then
  if lease > now then
    return {3, lease - now}
  end
  recovered = 1
elseif state == 78 then
  -- An N record's lease is live while its TTL is above the threshold it holds (a key without a
  -- TTL has no lease left).
  local ttl = redis.call('PTTL', key)
  if ttl > lease then
    return {3, ttl - lease}
  end
  recovered = 1
end

-- Fences only grow: one more than the last, and never below the server's clock in microseconds,
-- so a record that was lost (expired, flushed) still gets a fence above every earlier one.
local fence = math.max(last_fence + 1, now_us)
local attempt = last_attempt + 1
local lease_ms = tonumber(string.sub(args, 97, 111))
redis.call('SET', key,
  'R' .. string.sub(args, 1, 96) .. string.format('%015.0f%020.0f%010.0f%d', now + lease_ms, fence, attempt, recovered),
  'PX', string.format('%.0f', math.max(lease_ms, tonumber(string.sub(args, 112, 126)))))
return {1, fence, attempt, recovered}
