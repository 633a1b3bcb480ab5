#![doc = include_str!("../README.md")]
//!
//! # Where to read on
//!
//! [`server`]: what a protected call does, which tools are protected, what is stored, what the
//! tool gets. [`client`]: what [`ToolCaller`](client::ToolCaller) retries and how long it waits.
//! [`meta`]: the names in `_meta`.
#![deny(unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod client;
pub mod meta;
pub mod server;

pub use server::{DEFAULT_SCOPE, IdempotentServer, Unprotected};
