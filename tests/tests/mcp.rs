//! `idempotent-mcp` against real rmcp servers and clients over streamable HTTP on loopback: what a
//! protected `tools/call` does (the first runs once, a retry replays, other arguments are refused,
//! a duplicate in flight waits or is refused), which tools are protected, what is stored, where
//! the key comes from, and 500 calls through a proxy that loses replies.
//!
//! The process kills are in `mcp_restart.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use idempotent_core::{Backoff, MemoryStore, OnInFlight, RedisStore, SharedStore, SqliteStore};
use idempotent_mcp::client::{KeyedCall, ToolCaller};
use idempotent_mcp::{IdempotentServer, meta};
use idempotent_tests::HookedStore;
use idempotent_tests::ledger::Ledger;
use idempotent_tests::mcp::{HttpEndpoint, Payments, call, http_client, refund};
use idempotent_tests::proxy::LossyProxy;
use rmcp::ServiceError;
use rmcp::model::{CallToolResult, ErrorCode, RequestMetaObject};
use rmcp::service::{RoleClient, RunningService};
use serde_json::{Value, json};

type Configure = Arc<dyn Fn(IdempotentServer<Payments>) -> IdempotentServer<Payments> + Send + Sync>;

/// A payments server behind an `IdempotentServer` on `store`, configured by `configure`, served
/// over streamable HTTP, with a client.
struct Setup {
    payments: Payments,
    ledger: Ledger,
    endpoint: HttpEndpoint,
    client: RunningService<RoleClient, rmcp::model::ClientConfig>,
    _dir: tempfile::TempDir,
}

impl Setup {
    async fn start(store: SharedStore, configure: Configure) -> Setup {
        Setup::start_with(store, configure, |payments| payments).await
    }

    async fn start_with(store: SharedStore, configure: Configure, adjust: impl FnOnce(Payments) -> Payments) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::at(dir.path().join("ledger"));
        let payments = adjust(Payments::new(ledger.clone()));
        let served = payments.clone();
        let endpoint =
            HttpEndpoint::start(move || configure(IdempotentServer::new(served.clone(), store.clone()))).await;
        let client = http_client(endpoint.addr(), &[]).await;
        Setup { payments, ledger, endpoint, client, _dir: dir }
    }

    fn caller(&self) -> ToolCaller {
        fast(ToolCaller::new(self.client.peer().clone()))
    }

    /// One attempt, without retries, under `key`.
    async fn once(
        &self,
        params: rmcp::model::CallToolRequestParams,
        key: &str,
    ) -> Result<CallToolResult, ServiceError> {
        send_once(&self.client, params, Some(json!(key))).await
    }
}

fn fast(caller: ToolCaller) -> ToolCaller {
    caller.backoff(Backoff::new(Duration::from_millis(5), Duration::from_millis(100)).max_attempts(10))
}

fn configure(
    f: impl Fn(IdempotentServer<Payments>) -> IdempotentServer<Payments> + Send + Sync + 'static,
) -> Configure {
    Arc::new(f)
}

fn memory() -> SharedStore {
    Arc::new(MemoryStore::new())
}

/// Sends one `tools/call`, with `key` (any JSON value) in `_meta` when given.
async fn send_once(
    client: &RunningService<RoleClient, rmcp::model::ClientConfig>,
    mut params: rmcp::model::CallToolRequestParams,
    key: Option<Value>,
) -> Result<CallToolResult, ServiceError> {
    if let Some(key) = key {
        let mut meta = RequestMetaObject::default();
        meta.insert(meta::KEY.to_owned(), key);
        params.meta = Some(meta);
    }
    client.peer().call_tool(params).await
}

/// The JSON-RPC error of a refused call.
fn refused(result: Result<CallToolResult, ServiceError>) -> rmcp::ErrorData {
    match result {
        Err(ServiceError::McpError(error)) => error,
        other => panic!("expected a JSON-RPC error, got {other:?}"),
    }
}

fn structured(result: &CallToolResult) -> &Value {
    result.structured_content.as_ref().expect("a structured result")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_with_the_same_key_gets_the_first_result_marked_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite: SharedStore = Arc::new(SqliteStore::connect(dir.path().join("records.db")).await.unwrap());
    for store in [memory(), sqlite] {
        let setup = Setup::start(store, configure(|s| s)).await;
        let caller = setup.caller();
        let call = KeyedCall::new(refund("o-1", 1500));
        let first = caller.send(&call).await.unwrap();
        let retry = caller.send(&call).await.unwrap();
        assert!(!meta::is_replayed(&first));
        assert!(meta::is_replayed(&retry), "{retry:?}");
        assert_eq!(structured(&first), structured(&retry));
        assert_eq!(setup.payments.runs("refund", "o-1"), 1);
        assert_eq!(setup.ledger.charges().len(), 1);
        // A new call (a new key) with the same arguments is another refund.
        let again = caller.call(refund("o-1", 1500)).await.unwrap();
        assert!(!meta::is_replayed(&again));
        assert_eq!(setup.payments.runs("refund", "o-1"), 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_duplicates_run_the_tool_once() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let setup = Setup::start_with(memory(), configure(|s| s), |p| p.gate(gate.clone())).await;
    let started = setup.payments.started();
    let call = KeyedCall::new(refund("o-64", 700));
    let caller = setup.caller();
    let first = tokio::spawn({
        let (caller, call) = (caller.clone(), call.clone());
        async move { caller.send(&call).await }
    });
    started.notified().await;
    let duplicates: Vec<_> = (0..63)
        .map(|_| {
            let (caller, call) = (caller.clone(), call.clone());
            tokio::spawn(async move { caller.send(&call).await })
        })
        .collect();
    gate.add_permits(1);
    let first = first.await.unwrap().unwrap();
    for duplicate in duplicates {
        let duplicate = duplicate.await.unwrap().unwrap();
        assert_eq!(structured(&duplicate), structured(&first));
        assert!(meta::is_replayed(&duplicate));
    }
    assert_eq!(setup.payments.runs("refund", "o-64"), 1);
    assert_eq!(setup.ledger.charges().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_flight_is_refused_as_retryable_when_the_server_says_so_and_the_caller_waits_it_out() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let setup =
        Setup::start_with(memory(), configure(|s| s.on_in_flight(OnInFlight::Reject)), |p| p.gate(gate.clone())).await;
    let started = setup.payments.started();
    let call = KeyedCall::new(refund("o-2", 300));
    let caller = setup.caller();
    let first = tokio::spawn({
        let (caller, call) = (caller.clone(), call.clone());
        async move { caller.send(&call).await }
    });
    started.notified().await;
    let error = refused(setup.once(refund("o-2", 300), call.key()).await);
    assert_eq!(error.code, ErrorCode::INTERNAL_ERROR);
    let data = error.data.clone().unwrap();
    assert_eq!(data["kind"], "inFlight", "{error:?}");
    assert_eq!(data["retryable"], true);
    assert!(data["retryAfterMs"].as_u64().unwrap() <= 1000, "{data}");
    assert!(error.message.contains("another attempt is still running"), "{}", error.message);
    // The caller retries after the server's hint until the first call is done.
    let waiting = tokio::spawn({
        let (caller, call) = (caller.clone(), call.clone());
        async move { caller.send(&call).await }
    });
    gate.add_permits(1);
    let first = first.await.unwrap().unwrap();
    let waited = waiting.await.unwrap().unwrap();
    assert_eq!(structured(&waited), structured(&first));
    assert_eq!(setup.payments.runs("refund", "o-2"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_other_arguments_or_another_tool_is_refused_and_nothing_runs() {
    let setup = Setup::start(memory(), configure(|s| s)).await;
    setup.once(refund("o-3", 100), "k-3").await.unwrap();
    for other in [refund("o-3", 999), call("decline", json!({ "order": "o-3" }))] {
        let error = refused(setup.once(other, "k-3").await);
        assert_eq!(error.code, ErrorCode::INVALID_PARAMS);
        assert_eq!(error.data.as_ref().unwrap()["kind"], "mismatch");
        assert_eq!(error.data.as_ref().unwrap()["retryable"], false);
        assert!(
            error.message.contains("first used for a call with other arguments or to another tool"),
            "{}",
            error.message
        );
    }
    assert_eq!(setup.payments.runs("refund", "o-3"), 1);
    assert_eq!(setup.payments.runs("decline", "o-3"), 0);
    // Absent arguments and an empty object are the same call.
    let empty = rmcp::model::CallToolRequestParams::new("decline");
    let mut with_empty = empty.clone();
    with_empty.arguments = Some(Default::default());
    let _ = setup.once(empty, "k-empty").await;
    let replay = setup.once(with_empty, "k-empty").await;
    assert!(
        !matches!(replay, Err(ServiceError::McpError(ref e)) if e.data.as_ref().unwrap()["kind"] == "mismatch"),
        "{replay:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_without_a_key_is_refused_when_keys_are_required_and_runs_unprotected_otherwise() {
    let setup = Setup::start(memory(), configure(|s| s.require_key(true))).await;
    let error = refused(send_once(&setup.client, refund("o-4", 100), None).await);
    assert_eq!(error.code, ErrorCode::INVALID_PARAMS);
    assert_eq!(error.data.as_ref().unwrap()["kind"], "missingKey");
    assert!(error.message.contains("dev.idempotent/key"), "{}", error.message);
    assert_eq!(setup.payments.runs("refund", "o-4"), 0);
    for (bad, why) in [(json!(7), "must be a string"), (json!(""), "is empty"), (json!("a\u{7}b"), "control character")]
    {
        let error = refused(send_once(&setup.client, refund("o-4", 100), Some(bad)).await);
        assert_eq!(error.data.as_ref().unwrap()["kind"], "invalidKey");
        assert!(error.message.contains(why), "{}", error.message);
    }
    assert_eq!(setup.payments.runs("refund", "o-4"), 0);

    let open = Setup::start(memory(), configure(|s| s)).await;
    for _ in 0..2 {
        let result = send_once(&open.client, refund("o-4", 100), None).await.unwrap();
        assert!(!meta::is_replayed(&result));
    }
    assert_eq!(open.payments.runs("refund", "o-4"), 2, "an unkeyed call is not protected");
    assert!(open.payments.attempts().is_empty(), "an unprotected call carries no attempt");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_tools_pass_through_untouched() {
    let setup = Setup::start(memory(), configure(|s| s.require_key(true))).await;
    setup.once(refund("o-5", 100), "k-5").await.unwrap();
    // No key needed, the same key as the refund is no mismatch, and nothing is replayed.
    let unkeyed = send_once(&setup.client, call("balance", json!({ "order": "o-5" })), None).await.unwrap();
    let keyed = setup.once(call("balance", json!({ "order": "o-5" })), "k-5").await.unwrap();
    assert_eq!(structured(&unkeyed)["reads"], 1);
    assert_eq!(structured(&keyed)["reads"], 2);
    assert!(!meta::is_replayed(&keyed));
    assert_eq!(structured(&keyed)["refunds"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_errors_are_stored_unless_told_not_to_and_protocol_errors_never_are() {
    let setup = Setup::start(memory(), configure(|s| s)).await;
    let first = setup.once(call("decline", json!({ "order": "o-6" })), "k-6").await.unwrap();
    let retry = setup.once(call("decline", json!({ "order": "o-6" })), "k-6").await.unwrap();
    assert_eq!(first.is_error, Some(true));
    assert!(meta::is_replayed(&retry));
    assert_eq!(retry.is_error, Some(true));
    assert_eq!(setup.payments.runs("decline", "o-6"), 1);
    for _ in 0..2 {
        let error = refused(setup.once(call("explode", json!({ "order": "o-6" })), "k-7").await);
        assert!(error.message.contains("provider answered 502"), "{}", error.message);
    }
    assert_eq!(setup.payments.runs("explode", "o-6"), 2, "a JSON-RPC error gives the key up");

    let not_stored = Setup::start(memory(), configure(|s| s.store_tool_errors(false))).await;
    for _ in 0..2 {
        let result = not_stored.once(call("decline", json!({ "order": "o-6" })), "k-6").await.unwrap();
        assert!(!meta::is_replayed(&result));
    }
    assert_eq!(not_stored.payments.runs("decline", "o-6"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_out_of_bounds_refuses_every_protected_call_and_says_which_bound() {
    let setup = Setup::start(memory(), configure(|s| s.lease(Duration::ZERO))).await;
    let error = refused(setup.once(refund("o-14", 100), "k-14").await);
    assert_eq!(error.data.as_ref().unwrap()["kind"], "config", "{error:?}");
    assert!(error.message.contains("lease"), "{}", error.message);
    assert_eq!(setup.payments.runs("refund", "o-14"), 0);
}

/// A tool that panics stores nothing and gives nothing up: the call's lease runs out, and the
/// retry runs the tool again as a recovered attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_that_panics_holds_its_key_until_the_lease_runs_out_then_the_retry_recovers() {
    let setup = Setup::start(memory(), configure(|s| s.lease(Duration::from_millis(300)))).await;
    let caller = setup.caller().timeout(Duration::from_millis(500));
    let result = caller.call(call("crash", json!({ "order": "o-13" }))).await.expect("the retry answers");
    assert_eq!(structured(&result)["run"], 2);
    assert_eq!(structured(&result)["recovered"], true, "{result:?}");
    assert_eq!(setup.payments.runs("crash", "o-13"), 2);
}

/// A result the store does not take (here, every `complete` fails) reaches the caller marked
/// `stored: false`; the tool's run stays counted, and a retry may run it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_the_store_did_not_take_reaches_the_caller_marked_unstored() {
    let failing: SharedStore = Arc::new(HookedStore::new(memory()).on_complete(|_call| {
        Box::pin(async {
            Err(idempotent_core::Error::Unavailable {
                store: "hooked".into(),
                op: "complete",
                reason: "injected".into(),
                source: None,
            })
        })
    }));
    let setup = Setup::start(failing, configure(|s| s.lease(Duration::from_millis(200)))).await;
    // `decline` has no step of its own (`refund`'s charge step would fail on this store too).
    let result = setup.once(call("decline", json!({ "order": "o-15" })), "k-15").await.unwrap();
    assert!(meta::is_unstored(&result), "{result:?}");
    assert_eq!(result.is_error, Some(true), "the tool's own answer");
    assert_eq!(setup.payments.runs("decline", "o-15"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_larger_than_the_cap_is_not_stored_and_says_so() {
    let setup = Setup::start(memory(), configure(|s| s.max_result_bytes(16))).await;
    for _ in 0..2 {
        let result = setup.once(refund("o-12", 100), "k-12").await.unwrap();
        assert!(meta::is_unstored(&result), "{result:?}");
        assert!(!meta::is_replayed(&result));
    }
    assert_eq!(setup.payments.runs("refund", "o-12"), 2, "the key was given up");
    let small = Setup::start(memory(), configure(|s| s)).await;
    let result = small.once(refund("o-12", 100), "k-12").await.unwrap();
    assert!(!meta::is_unstored(&result));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_derived_key_makes_one_operation_per_principal_and_is_advertised() {
    let store = memory();
    let setup = Setup::start(
        store,
        configure(|s| {
            s.derive_key_for("refund").tenant(|ctx| {
                let parts = ctx.extensions.get::<http::request::Parts>()?;
                Some(parts.headers.get("x-principal")?.to_str().ok()?.to_owned())
            })
        }),
    )
    .await;
    let alice = http_client(setup.endpoint.addr(), &[("x-principal", "alice")]).await;
    let bob = http_client(setup.endpoint.addr(), &[("x-principal", "bob")]).await;
    let a1 = send_once(&alice, refund("o-8", 100), None).await.unwrap();
    let a2 = send_once(&alice, refund("o-8", 100), None).await.unwrap();
    let b1 = send_once(&bob, refund("o-8", 100), None).await.unwrap();
    assert!(meta::is_replayed(&a2) && !meta::is_replayed(&b1));
    assert_eq!(structured(&a1), structured(&a2));
    assert_ne!(structured(&a1)["charge"], structured(&b1)["charge"]);
    assert_eq!(setup.payments.runs("refund", "o-8"), 2, "one refund per principal");
    // Other arguments derive another key: a new operation, not a mismatch.
    send_once(&alice, refund("o-8", 200), None).await.unwrap();
    assert_eq!(setup.payments.runs("refund", "o-8"), 3);

    let tools = setup.client.peer().list_all_tools().await.unwrap();
    let hint = |name: &str| {
        tools.iter().find(|t| t.name == name).unwrap().annotations.as_ref().and_then(|a| a.idempotent_hint)
    };
    assert_eq!(hint("refund"), Some(true), "a derived key protects every call");
    assert_eq!(hint("decline"), None, "keys are optional for decline");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_principals_sending_the_same_key_never_share_a_result() {
    let setup = Setup::start(
        memory(),
        configure(|s| {
            s.require_key(true).tenant(|ctx| {
                let parts = ctx.extensions.get::<http::request::Parts>()?;
                Some(parts.headers.get("x-principal")?.to_str().ok()?.to_owned())
            })
        }),
    )
    .await;
    let alice = http_client(setup.endpoint.addr(), &[("x-principal", "alice")]).await;
    let bob = http_client(setup.endpoint.addr(), &[("x-principal", "bob")]).await;
    let a = send_once(&alice, refund("o-9", 100), Some(json!("shared"))).await.unwrap();
    let b = send_once(&bob, refund("o-9", 100), Some(json!("shared"))).await.unwrap();
    assert!(!meta::is_replayed(&b));
    assert_ne!(structured(&a)["charge"], structured(&b)["charge"]);
    assert_eq!(setup.payments.runs("refund", "o-9"), 2);
    let tools = setup.client.peer().list_all_tools().await.unwrap();
    let refund_tool = tools.iter().find(|t| t.name == "refund").unwrap();
    assert_eq!(refund_tool.annotations.as_ref().and_then(|a| a.idempotent_hint), Some(true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_runs_under_the_calls_attempt_and_every_other_request_reaches_the_handler() {
    let setup = Setup::start(memory(), configure(|s| s)).await;
    let result = setup.once(refund("o-10", 100), "k-10").await.unwrap();
    let attempts = setup.payments.attempts();
    assert_eq!(attempts.len(), 1);
    assert!(attempts[0].fence() > 0 && !attempts[0].recovered());
    assert_eq!(structured(&result)["fence"], attempts[0].fence());
    // The charge ran as a step of the call, under its own downstream key.
    let charges = setup.ledger.charges();
    assert_eq!(charges.len(), 1);
    assert_ne!(charges[0].key, attempts[0].downstream_key().as_str());
    // Forwarded untouched: a ping and the handler's resources (the default would list none).
    setup.client.peer().send_request(rmcp::model::ClientRequest::PingRequest(Default::default())).await.unwrap();
    let resources = setup.client.peer().list_all_resources().await.unwrap();
    assert_eq!(resources.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_cannot_be_reached_fails_the_call_closed_as_retryable() {
    let port = idempotent_tests::free_port(false);
    let store: SharedStore = Arc::new(RedisStore::connect_lazy(format!("redis://127.0.0.1:{port}")).unwrap());
    let setup = Setup::start(store, configure(|s| s)).await;
    let error = refused(setup.once(refund("o-11", 100), "k-11").await);
    let data = error.data.as_ref().unwrap();
    assert_eq!(data["kind"], "unavailable", "{error:?}");
    assert_eq!(data["retryable"], true);
    assert_eq!(data["actionMayHaveRun"], false);
    assert_eq!(setup.payments.runs("refund", "o-11"), 0);

    // Failing open, the tool runs unprotected, under an attempt that says so.
    let store: SharedStore = Arc::new(RedisStore::connect_lazy(format!("redis://127.0.0.1:{port}")).unwrap());
    let open = Setup::start(store, configure(|s| s.fail_mode(idempotent_core::FailMode::Open))).await;
    let result = open.once(refund("o-11", 100), "k-11").await.unwrap();
    assert!(!meta::is_replayed(&result));
    let attempts = open.payments.attempts();
    assert_eq!(attempts.len(), 1);
    assert!(attempts[0].is_unprotected() && attempts[0].fence() == 0);
}

/// 500 logical calls from 16 callers through a proxy that loses a third of the replies after the
/// server answered: exactly 500 charges, and every caller's final result is its one execution's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_calls_through_a_proxy_that_loses_replies_make_exactly_five_hundred_charges() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::at(dir.path().join("ledger"));
    let payments = Payments::new(ledger.clone());
    let store: SharedStore = Arc::new(SqliteStore::connect(dir.path().join("records.db")).await.unwrap());
    let served = payments.clone();
    let endpoint = HttpEndpoint::start(move || IdempotentServer::new(served.clone(), store.clone())).await;
    let armed = Arc::new(AtomicBool::new(false));
    let posts = Arc::new(AtomicU64::new(0));
    let proxy = LossyProxy::start(endpoint.addr(), {
        let (armed, posts) = (armed.clone(), posts.clone());
        move |head| {
            armed.load(Ordering::SeqCst) && head.starts_with("POST") && posts.fetch_add(1, Ordering::SeqCst) % 3 == 0
        }
    })
    .await;
    // One request per connection, so that every request passes the proxy's choice.
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let config = rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(format!(
        "http://{}/mcp",
        proxy.addr()
    ));
    let transport = rmcp::transport::StreamableHttpClientTransport::with_client(http, config);
    let client = rmcp::ServiceExt::serve(rmcp::model::ClientConfig::default(), transport).await.unwrap();
    armed.store(true, Ordering::SeqCst);
    let caller = ToolCaller::new(client.peer().clone())
        .backoff(Backoff::new(Duration::from_millis(2), Duration::from_millis(50)).max_attempts(20))
        .timeout(Duration::from_secs(10))
        .budget(idempotent_mcp::client::TpsBudget::new(Duration::from_secs(10), 10_000, 10.0));
    let next = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..16)
        .map(|_| {
            let (caller, next) = (caller.clone(), next.clone());
            tokio::spawn(async move {
                let mut results = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= 500 {
                        return results;
                    }
                    let result =
                        caller.call(refund(&format!("o-{i}"), 100 + i)).await.expect("every call ends with a result");
                    results.push((i, result));
                }
            })
        })
        .collect();
    let mut results = Vec::new();
    for worker in workers {
        results.extend(worker.await.unwrap());
    }
    assert_eq!(results.len(), 500);
    let charges = ledger.charges();
    assert_eq!(charges.len(), 500, "exactly one charge per logical call");
    let replayed = results.iter().filter(|(_, r)| meta::is_replayed(r)).count();
    for (i, result) in &results {
        let charge = structured(result)["charge"].as_str().unwrap();
        let made: Vec<_> = charges.iter().filter(|c| c.id == charge).collect();
        assert_eq!(made.len(), 1, "call {i}'s result names its one charge");
        assert_eq!(made[0].amount, 100 + i);
        assert_eq!(payments.runs("refund", &format!("o-{i}")), 1, "call {i} ran once");
    }
    assert!(proxy.lost() >= 100, "the proxy lost only {} replies", proxy.lost());
    assert!(replayed >= 100, "only {replayed} calls ended on a replay");
    eprintln!("500 calls: {} replies lost, {replayed} calls ended on a replay", proxy.lost());
}
