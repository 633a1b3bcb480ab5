//! The gRPC status code: what the server layer answers with, what its store policy reads and
//! what the retry policy retries on.
//!
//! tower-http has `classify::GrpcCode`, an enum of the 17 codes. It does not fit here: it has no
//! equality (a retry policy compares codes), no way back to the number (the server writes it in
//! `grpc-status`), and it reads every number outside 0-16 as `UNKNOWN`, so a policy retrying on
//! `UNKNOWN` would also retry on a server's own codes. This type keeps the number.

use http::StatusCode;

/// A gRPC status code, as carried in `grpc-status`.
///
/// Any `i32` is a code: numbers outside the 17 that gRPC defines are kept as they are, not folded
/// into `UNKNOWN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrpcCode(i32);

impl GrpcCode {
    /// `OK` (0).
    pub const OK: GrpcCode = GrpcCode(0);
    /// `CANCELLED` (1).
    pub const CANCELLED: GrpcCode = GrpcCode(1);
    /// `UNKNOWN` (2).
    pub const UNKNOWN: GrpcCode = GrpcCode(2);
    /// `INVALID_ARGUMENT` (3): the server layer's answer to a missing or invalid key.
    pub const INVALID_ARGUMENT: GrpcCode = GrpcCode(3);
    /// `DEADLINE_EXCEEDED` (4).
    pub const DEADLINE_EXCEEDED: GrpcCode = GrpcCode(4);
    /// `NOT_FOUND` (5).
    pub const NOT_FOUND: GrpcCode = GrpcCode(5);
    /// `ALREADY_EXISTS` (6).
    pub const ALREADY_EXISTS: GrpcCode = GrpcCode(6);
    /// `PERMISSION_DENIED` (7).
    pub const PERMISSION_DENIED: GrpcCode = GrpcCode(7);
    /// `RESOURCE_EXHAUSTED` (8): the server layer's answer to a request body over its limit.
    pub const RESOURCE_EXHAUSTED: GrpcCode = GrpcCode(8);
    /// `FAILED_PRECONDITION` (9): the server layer's "this key was used for another payload".
    pub const FAILED_PRECONDITION: GrpcCode = GrpcCode(9);
    /// `ABORTED` (10): the server layer's "the same key is still running".
    pub const ABORTED: GrpcCode = GrpcCode(10);
    /// `OUT_OF_RANGE` (11).
    pub const OUT_OF_RANGE: GrpcCode = GrpcCode(11);
    /// `UNIMPLEMENTED` (12).
    pub const UNIMPLEMENTED: GrpcCode = GrpcCode(12);
    /// `INTERNAL` (13).
    pub const INTERNAL: GrpcCode = GrpcCode(13);
    /// `UNAVAILABLE` (14): the server layer's answer when its store is unreachable.
    pub const UNAVAILABLE: GrpcCode = GrpcCode(14);
    /// `DATA_LOSS` (15).
    pub const DATA_LOSS: GrpcCode = GrpcCode(15);
    /// `UNAUTHENTICATED` (16).
    pub const UNAUTHENTICATED: GrpcCode = GrpcCode(16);

    /// The code with this number (as `tonic::Code as i32` gives).
    pub const fn new(code: i32) -> Self {
        GrpcCode(code)
    }

    /// The code's number.
    pub const fn get(self) -> i32 {
        self.0
    }

    /// The code gRPC clients report for a non-200 HTTP status (gRPC's
    /// `http-grpc-status-mapping.md`).
    pub(crate) fn from_http(status: StatusCode) -> GrpcCode {
        match status.as_u16() {
            400 => GrpcCode::INTERNAL,
            401 => GrpcCode::UNAUTHENTICATED,
            403 => GrpcCode::PERMISSION_DENIED,
            404 => GrpcCode::UNIMPLEMENTED,
            429 | 502 | 503 | 504 => GrpcCode::UNAVAILABLE,
            _ => GrpcCode::UNKNOWN,
        }
    }
}

impl From<i32> for GrpcCode {
    fn from(code: i32) -> Self {
        GrpcCode(code)
    }
}
