//! The MCP rows: a `tools/call` of `mcp_bench`'s tool (`idempotent_benches::mcp::Refunds`),
//! client and server both counted, next to the same call to the bare tool on the same transport;
//! `IdempotentServer` on a `MemoryStore`, first execution (a new key per call) and replay (the
//! first 1000 keys again, stored by the first-execution row).
//!
//! Two transports: rmcp over an in-process pipe (`tokio::io::duplex`: rmcp's JSON-RPC framing and
//! dispatch, no HTTP) and over streamable HTTP on loopback, as `mcp_bench` serves it (axum and
//! rmcp's reqwest client; each call one HTTP request). On each, a row of the bare tool called with
//! a key in `_meta` tells what carrying the key costs from what the protection does; the `MCP
//! part` rows count the protection's own steps one by one.

use idempotent_benches::mcp::{Refunds, duplex_client, http_client, http_service, refund_call, serve};
use std::hint::black_box;

use idempotent_core::{Fingerprint, Key, MemoryStore};
use idempotent_mcp::{IdempotentServer, meta};
use rmcp::model::{CallToolResult, ClientConfig, JsonObject};
use rmcp::service::{RoleClient, RunningService};
use rmcp::{Peer, ServerHandler};
use serde_json::json;

use super::{per_call, row};

/// The MCP rows, in the order [`mcp_rows`] prints them.
pub(crate) const MCP_ROWS: [&str; 13] = [
    "floor: bare rmcp tool, MCP over duplex",
    "bare rmcp tool, MCP over duplex, a key in `_meta`",
    "IdempotentServer + MemoryStore, MCP over duplex, first execution",
    "IdempotentServer + MemoryStore, MCP over duplex, replay",
    "floor: bare rmcp tool, MCP over streamable HTTP",
    "bare rmcp tool, MCP over streamable HTTP, a key in `_meta`",
    "IdempotentServer + MemoryStore, MCP over streamable HTTP, first execution",
    "IdempotentServer + MemoryStore, MCP over streamable HTTP, replay",
    "MCP part: `get_tool` (the read-only check)",
    "MCP part: `Fingerprint::of` the tool and its arguments",
    "MCP part: `Key::from_client_key`",
    "MCP part: encode the result (`serde_json::to_vec`)",
    "MCP part: decode a stored result (`serde_json::from_slice::<CallToolResult>`)",
];

/// One `tools/call` of `refund` under `key`; whether the reply was a replay.
async fn call(peer: &Peer<RoleClient>, key: Option<String>) -> bool {
    let result = peer.call_tool(refund_call(key)).await.expect("tools/call");
    assert_ne!(result.is_error, Some(true), "the tool failed: {result:?}");
    meta::is_replayed(&result)
}

/// The key of the `i`th first execution (a replay repeats one of the first 1000).
fn first(i: u64) -> Option<String> {
    Some(format!("first-{i}"))
}

/// Counts `calls` calls to `peer`, the `i`th under `key(i)`, each reply a replay exactly when
/// `replayed`.
async fn counted(
    calls: u64,
    peer: &Peer<RoleClient>,
    key: fn(u64) -> Option<String>,
    replayed: bool,
) -> (f64, f64, f64) {
    per_call(calls, |i| async move { assert_eq!(call(peer, key(i)).await, replayed) }).await
}

/// The rows of one transport: `bare` and `protected` are clients of the bare tool and of the
/// protected one.
async fn rows(
    calls: u64,
    want: &impl Fn(&str) -> bool,
    [floor_name, keyed_name, first_name, replay_name]: [&str; 4],
    bare: RunningService<RoleClient, ClientConfig>,
    protected: RunningService<RoleClient, ClientConfig>,
) {
    let (bare, protected) = (bare.peer().clone(), protected.peer().clone());
    let mut floor = None;
    if want(floor_name) {
        let floor_counted = counted(calls, &bare, |_| None, false).await;
        row(floor_name, floor_counted, None);
        floor = Some(floor_counted);
    }
    if want(keyed_name) {
        // What carrying the key costs client and server, without the protection.
        row(keyed_name, counted(calls, &bare, first, false).await, floor);
    }
    if want(first_name) {
        row(first_name, counted(calls, &protected, first, false).await, floor);
    } else if want(replay_name) {
        for i in 0..1000 {
            call(&protected, first(i)).await;
        }
    }
    if want(replay_name) {
        row(replay_name, counted(calls, &protected, |i| first(i % 1000), true).await, floor);
    }
}

/// The MCP rows whose name `want`s, `calls` per row (after as many warm-up calls).
pub(crate) async fn mcp_rows(calls: u64, want: &impl Fn(&str) -> bool) {
    let [d0, d1, d2, d3, h0, h1, h2, h3, ..] = MCP_ROWS;
    if [d0, d1, d2, d3].iter().any(|name| want(name)) {
        let bare = duplex_client(Refunds::default()).await;
        let protected = duplex_client(IdempotentServer::new(Refunds::default(), MemoryStore::new())).await;
        rows(calls, want, [d0, d1, d2, d3], bare, protected).await;
    }
    if [h0, h1, h2, h3].iter().any(|name| want(name)) {
        let router = axum::Router::new()
            .nest_service("/bare", http_service(Refunds::default()))
            .nest_service("/memory", http_service(IdempotentServer::new(Refunds::default(), MemoryStore::new())));
        let addr = serve(router).await;
        let bare = http_client(format!("http://{addr}/bare"), true).await;
        let protected = http_client(format!("http://{addr}/memory"), true).await;
        rows(calls, want, [h0, h1, h2, h3], bare, protected).await;
    }
    parts(calls, want).await;
}

/// The protection's own steps for one call, each alone (what `idempotent_mcp::server::call`
/// does around the store): each row's allocations are part of the difference above.
async fn parts(calls: u64, want: &impl Fn(&str) -> bool) {
    let [.., get_tool, fingerprint, key, encode, decode] = MCP_ROWS;
    let handler = Refunds::default();
    let params = refund_call(None);
    let result = CallToolResult::structured(json!({
        "refund_id": "re_3PqX7yLkd82Hf0Zs1mN4", "order": "ord_7Hq2mXK9pLzV4rT1", "cents": 1500, "status": "succeeded",
    }));
    let stored = serde_json::to_vec(&result).unwrap();
    let empty = JsonObject::new();
    let steps: [(&str, &dyn Fn(u64)); 5] = [
        (get_tool, &|_| {
            black_box(handler.get_tool("refund"));
        }),
        (fingerprint, &|_| {
            black_box(Fingerprint::of(&("refund", params.arguments.as_ref().unwrap_or(&empty))).unwrap());
        }),
        (key, &|i| {
            black_box(Key::from_client_key(None, "mcp", &format!("first-{i}")));
        }),
        (encode, &|_| {
            black_box(serde_json::to_vec(&result).unwrap());
        }),
        (decode, &|_| {
            black_box(serde_json::from_slice::<CallToolResult>(&stored).unwrap());
        }),
    ];
    for (name, step) in steps {
        if want(name) {
            row(name, per_call(calls, |i| async move { step(i) }).await, None);
        }
    }
}
