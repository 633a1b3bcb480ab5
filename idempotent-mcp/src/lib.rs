//! Exactly-once MCP tool calls on rmcp.
#![deny(unreachable_pub)]
#![warn(missing_docs)]
