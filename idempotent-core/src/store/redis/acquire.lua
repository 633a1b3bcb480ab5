-- acquire: take the operation's key, or say why not.
--
-- The store tries a plain `SET key <N record> NX GET PX <ttl>` first: it takes an absent key
-- and returns any record that is there, so a replay and a first acquisition are one command
-- and no script. This script runs when that found a running or released record (or when the
-- server refuses that form of SET, before Redis 7.0); it also takes an absent key itself.
--
-- KEYS[1]  the operation's record (layout in layout.lua)
-- ARGV[1]  fingerprint, new owner token, lease, retention and labels, packed (layout in
--          layout.lua). A
--          retry of an acquire whose reply was lost sends the same token and gets the same
--          answer: acquire is idempotent per token.
--
-- Replies
--   the whole record                done: the client compares the fingerprint and replays the
--                                   result, or answers Mismatch
--   {1, fence, attempt, recovered}  acquired (recovered = 1 when a previous lease ran out, or
--                                   the previous attempt was released uncertain)
--   {3, retry_after_ms}             another owner's lease is live
--   {4}                             the record has another fingerprint
--   {5, attempt, fence}             the record needs attention (abandoned by that attempt)
--   error IDEMPOTENT_CORRUPT ...    the key holds something these scripts did not write
local key, args = KEYS[1], ARGV[1]
if #args < ACQUIRE_ARG_MIN_LEN or labels_size(args, ARG_LABELS_FROM) ~= #args - ARG_LABELS_FROM + 1 then
  return redis.error_reply('IDEMPOTENT_CORRUPT arguments: expected fingerprint (64), token (32), lease and retention (15 digits each), then the labels')
end
local ok, rec = pcall(redis.call, 'GET', key)
if not ok then
  return redis.error_reply('IDEMPOTENT_CORRUPT the key holds another type than a string')
end

local state, last_fence, last_attempt, lease = nil, 0, 0, nil
if rec then
  state = string.sub(rec, STATE, STATE)
  if state == DONE and result_from(rec) then
    -- A retried acquire of the token that completed the key has the same fingerprint: it
    -- replays.
    return rec
  end
  if not is_running(rec) then
    return redis.error_reply('IDEMPOTENT_CORRUPT the key holds a string that is not a record')
  end
  -- Digits only: Lua's tonumber would also take 'nan', 'inf', '0x..', '1e18' and signs.
  local lease_s = string.sub(rec, LEASE_FROM, LEASE_TO)
  local fence_s = string.sub(rec, FENCE_FROM, FENCE_TO)
  local attempt_s = string.sub(rec, ATTEMPT_FROM, ATTEMPT_TO)
  if not (string.find(lease_s, '^%d+$') and string.find(fence_s, '^%d+$') and string.find(attempt_s, '^%d+$')) then
    return redis.error_reply('IDEMPOTENT_CORRUPT the record has a malformed number')
  end
  lease, last_fence, last_attempt = tonumber(lease_s), tonumber(fence_s), tonumber(attempt_s)
  if last_fence >= MAX_FENCE then
    return redis.error_reply('IDEMPOTENT_CORRUPT the record has a fence beyond 2^53')
  end
  if state == NEEDS_ATTENTION then
    -- Nothing runs until the record is resolved, whoever asks (its own token included).
    if string.sub(rec, FINGERPRINT_FROM, FINGERPRINT_TO) ~= string.sub(args, ARG_FINGERPRINT_FROM, ARG_FINGERPRINT_TO) then
      return {4}
    end
    return {5, last_attempt, last_fence}
  end
  -- This token already acquired the key: a retry, or a late duplicate, of an acquire whose
  -- reply was lost. Answer as then, and change nothing but write the record again as it is (TTL
  -- kept), so that the repeat replicates like the first write: a WAIT behind it then covers the
  -- acquisition whichever connection the first one went out on.
  if string.sub(rec, TOKEN_FROM, TOKEN_TO) == string.sub(args, ARG_TOKEN_FROM, ARG_TOKEN_TO) then
    redis.call('SET', key, rec, 'KEEPTTL')
    return {1, last_fence, last_attempt, string.sub(rec, RECOVERED, RECOVERED) == '1' and 1 or 0}
  end
  if string.sub(rec, FINGERPRINT_FROM, FINGERPRINT_TO) ~= string.sub(args, ARG_FINGERPRINT_FROM, ARG_FINGERPRINT_TO) then
    return {4}
  end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local recovered = 0
if state == RUNNING then
  if lease > now then
    return {3, lease - now}
  end
  recovered = 1
elseif state == NEW then
  -- An N record's lease is live while its TTL is above the threshold it holds (a key without a
  -- TTL has no lease left).
  local ttl = redis.call('PTTL', key)
  if ttl > lease then
    return {3, ttl - lease}
  end
  recovered = 1
elseif state == RELEASED then
  -- Released uncertain (abandon): the next attempt is recovered at once.
  recovered = string.sub(rec, RECOVERED, RECOVERED) == '1' and 1 or 0
end

-- Fences only grow: one more than the last, and never below the server's clock in microseconds,
-- so a record that was lost (expired, flushed) still gets a fence above every earlier one.
local fence = math.max(last_fence + 1, now_us)
local attempt = last_attempt + 1
local lease_ms = tonumber(string.sub(args, ARG_LEASE_FROM, ARG_LEASE_TO))
-- A record that lives on (released, or its lease passed) keeps its creation time and labels; a
-- new one takes the argument's labels.
local created, labels = string.format(TIME_FORMAT, now), string.sub(args, ARG_LABELS_FROM)
if rec then
  created, labels = string.sub(rec, CREATED_FROM, CREATED_TO), string.sub(rec, STEP_LEN_FROM)
end
-- The new record: R, then the argument's fingerprint and token, which sit in the same order.
redis.call('SET', key,
  RUNNING .. string.sub(args, ARG_FINGERPRINT_FROM, ARG_TOKEN_TO) .. string.format(RUNNING_TAIL_FORMAT, now + lease_ms, fence, attempt, recovered)
    .. created .. string.format(TIME_FORMAT, now) .. labels,
  'PX', string.format('%.0f', math.max(lease_ms, tonumber(string.sub(args, ARG_RETENTION_FROM, ARG_RETENTION_TO)))))
return {1, fence, attempt, recovered}
