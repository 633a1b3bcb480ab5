-- layout: where each field of a record sits, shared by every script (the store prepends this
-- file to each of them). Positions are 1-based and inclusive, as string.sub counts; layout.rs
-- holds the same layout as Rust ranges (0-based, end exclusive: X_FROM - 1 .. X_TO), and a
-- test there checks that the two agree.
--
-- A record is one string, HEADER_LEN bytes of fixed-width fields, then the labels' text, then
-- (done records) the result:
--   state       R running, N new (running, written by SET NX), X released, A needs attention
--               (kept without a TTL until resolved), C done
--   fingerprint the payload's, 64 hex characters
--   token       owner token of the last acquisition, 32 characters (C: the one that completed)
--   lease       R: lease deadline, milliseconds of server time, 15 digits
--               N: the TTL in milliseconds at or below which the lease has passed (the record's
--                  TTL minus the lease, 15 digits): a SET cannot read the server's clock, so the
--                  lease of an N record is judged by its TTL
--               X, A, C: unused (what the running record held)
--   fence       20 digits: the last attempt's (A: the attempt that left it; C: that completed)
--   attempt     10 digits: that attempt's number
--   recovered   R, N: 1 when a previous lease ran out, else 0
--               X: 1 when the attempt that released it may have run the action (abandoned as
--                  uncertain, or released by fence: the next acquisition is recovered), else 0
--               A, C: what the running record held
--   created     when the record's current life began (its first acquisition since it was
--               absent), milliseconds of server time, 15 digits. N: the client's estimate of the
--               server's clock (the fence, in milliseconds: see clock.rs), as a SET cannot read
--               the server's clock
--   updated     when the record last changed, milliseconds of server time, 15 digits (N: as
--               created)
--   labels      the lengths of the step, run id and tenant, 5 digits each, then 1 or 0 for
--               whether a run id is given and whether a tenant is; their text follows the header
-- then, for C, the encoded result to the end. No other layout is read.
local STATE = 1
local RUNNING, NEW, RELEASED, NEEDS_ATTENTION, DONE = 'R', 'N', 'X', 'A', 'C'
local FINGERPRINT_FROM, FINGERPRINT_TO = 2, 65
local TOKEN_FROM, TOKEN_TO = 66, 97
local LEASE_FROM, LEASE_TO = 98, 112
local FENCE_FROM, FENCE_TO = 113, 132
local ATTEMPT_FROM, ATTEMPT_TO = 133, 142
local RECOVERED = 143
local CREATED_FROM, CREATED_TO = 144, 158
local UPDATED_FROM, UPDATED_TO = 159, 173
local STEP_LEN_FROM, STEP_LEN_TO = 174, 178
local RUN_LEN_FROM, RUN_LEN_TO = 179, 183
local TENANT_LEN_FROM, TENANT_LEN_TO = 184, 188
local RUN_SET = 189
local TENANT_SET = 190
local HEADER_LEN = 190
-- string.format patterns of the digit fields: the lease alone, every field from the lease to
-- the recovered byte, and a time (created, updated).
local LEASE_FORMAT = '%015.0f'
local RUNNING_TAIL_FORMAT = '%015.0f%020.0f%010.0f%d'
local TIME_FORMAT = '%015.0f'
-- Fences stay below 2^53, where Lua's doubles count exactly.
local MAX_FENCE = 9007199254740992

-- acquire's one argument (one, because Redis hands every argument to Lua as a new string):
--   fingerprint 64 hex characters
--   token       the new owner token, 32 characters
--   lease       milliseconds, 15 digits
--   retention   milliseconds, 15 digits (the record's TTL is max(lease, retention))
--   labels      from ARG_LABELS_FROM to the end: the record's labels section (lengths, flags,
--               then the text), as a new record holds it from STEP_LEN_FROM on
local ARG_FINGERPRINT_FROM, ARG_FINGERPRINT_TO = 1, 64
local ARG_TOKEN_FROM, ARG_TOKEN_TO = 65, 96
local ARG_LEASE_FROM, ARG_LEASE_TO = 97, 111
local ARG_RETENTION_FROM, ARG_RETENTION_TO = 112, 126
local ARG_LABELS_FROM = 127
local ACQUIRE_ARG_MIN_LEN = 143

-- The server's clock in milliseconds.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The pattern of a labels section's head: three lengths of as many digits as STEP_LEN holds,
-- then the two flags. (A literal: a library's load cannot call string functions.)
local LABELS_HEAD = '^(%d%d%d%d%d)(%d%d%d%d%d)(%d%d%d%d%d)[01][01]'

-- The size of the labels section that starts at `at` in `s` (its lengths and flags, then the
-- text), or nil when its lengths are not digits, a flag is neither 0 nor 1, or the text runs
-- past the end of `s`.
local function labels_size(s, at)
  local step, run, tenant = string.match(s, LABELS_HEAD, at)
  if not step then
    return nil
  end
  local size = HEADER_LEN - STEP_LEN_FROM + 1 + tonumber(step) + tonumber(run) + tonumber(tenant)
  if at + size - 1 > #s then
    return nil
  end
  return size
end

-- Whether `rec` is a running, new, released or needs-attention record: the header and its
-- labels, nothing after.
local function is_running(rec)
  local state = string.sub(rec, STATE, STATE)
  if state ~= RUNNING and state ~= NEW and state ~= RELEASED and state ~= NEEDS_ATTENTION then
    return false
  end
  return #rec >= HEADER_LEN and labels_size(rec, STEP_LEN_FROM) == #rec - STEP_LEN_FROM + 1
end

-- Where the result of a done record starts (after its labels), or nil when `rec` is not a done
-- record.
local function result_from(rec)
  local state = string.sub(rec, STATE, STATE)
  if state == DONE and #rec >= HEADER_LEN then
    local size = labels_size(rec, STEP_LEN_FROM)
    return size and STEP_LEN_FROM + size
  end
  return nil
end

