//! Client side: see the crate docs.
