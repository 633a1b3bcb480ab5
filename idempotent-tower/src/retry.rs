//! Retry policy: see the crate docs.
