//! Server side: see the crate docs.
