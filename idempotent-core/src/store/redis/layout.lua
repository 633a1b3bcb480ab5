-- layout: where each field of a record sits, shared by every script (the store prepends this
-- file to each of them). Positions are 1-based and inclusive, as string.sub counts; layout.rs
-- holds the same layout as Rust ranges (0-based, end exclusive: X_FROM - 1 .. X_TO), and a
-- test there checks that the two agree.
--
-- A record is one string:
--   state       R running, N new (running, written by SET NX), X released, A needs attention
--               (kept without a TTL until resolved), D done
--   fingerprint the payload's, 64 hex characters
--   token       owner token of the last acquisition, 32 characters
-- then, for R, N, X and A (RUNNING_LEN bytes in all):
--   lease       R: lease deadline, milliseconds of server time, 15 digits
--               N: the TTL in milliseconds at or below which the lease has passed (the record's
--                  TTL minus the lease, 15 digits): a SET cannot read the server's clock, so the
--                  lease of an N record is judged by its TTL
--               X, A: unused (what the running record held)
--   fence       20 digits (A: the fence of the attempt that left it)
--   attempt     10 digits (A: that attempt's number)
--   recovered   R, N: 1 when a previous lease ran out, else 0
--               X: 1 when the attempt that released it may have run the action (abandoned as
--                  uncertain: the next acquisition is recovered), else 0
--               A: unused
-- or, for D, the encoded result to the end (no fence is kept: nothing acquires a done key).
local STATE = 1
local RUNNING, NEW, RELEASED, NEEDS_ATTENTION, DONE = 'R', 'N', 'X', 'A', 'D'
local FINGERPRINT_FROM, FINGERPRINT_TO = 2, 65
local TOKEN_FROM, TOKEN_TO = 66, 97
local LEASE_FROM, LEASE_TO = 98, 112
local FENCE_FROM, FENCE_TO = 113, 132
local ATTEMPT_FROM, ATTEMPT_TO = 133, 142
local RECOVERED = 143
local RUNNING_LEN = 143
local RESULT_FROM = 98
-- string.format patterns of the digit fields: the lease alone, and every field after the token.
local LEASE_FORMAT = '%015.0f'
local RUNNING_TAIL_FORMAT = '%015.0f%020.0f%010.0f%d'
-- Fences stay below 2^53, where Lua's doubles count exactly.
local MAX_FENCE = 9007199254740992

-- acquire's one argument (one, because Redis hands every argument to Lua as a new string):
--   fingerprint 64 hex characters
--   token       the new owner token, 32 characters
--   lease       milliseconds, 15 digits
--   retention   milliseconds, 15 digits (the record's TTL is max(lease, retention))
local ARG_FINGERPRINT_FROM, ARG_FINGERPRINT_TO = 1, 64
local ARG_TOKEN_FROM, ARG_TOKEN_TO = 65, 96
local ARG_LEASE_FROM, ARG_LEASE_TO = 97, 111
local ARG_RETENTION_FROM, ARG_RETENTION_TO = 112, 126
local ACQUIRE_ARG_LEN = 126

