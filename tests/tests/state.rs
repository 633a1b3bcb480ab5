//! The state store conformance suite (`idempotent_tests::state`) on every store, through the
//! fault proxy losing 20% of replies, and combined with steps.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures_util::future::join_all;
use idempotent_core::state::{MemoryStateStore, SharedStateStore, State};
use idempotent_core::{Backoff, Error, MemoryStore, PostgresStore, RedisStore, RunContext, SharedStore, SqliteStore};
use idempotent_tests::proxy::{Fault, FaultProxy};
use idempotent_tests::state::{counter, fresh_scope, patient, run_all};
use idempotent_tests::{HookedStore, PgServer, RedisCluster, RedisServer};

idempotent_tests::on_every_store!(one_handle_serves_steps_and_state);

/// The handle a `RunContext` is given (a `SharedStore`) serves `State::new` as well: the crate's
/// stores keep versioned states too, so an application holds one handle to one store.
async fn one_handle_serves_steps_and_state(store: SharedStore) {
    let scope = fresh_scope("one-handle");
    let ctx = RunContext::new(store.clone(), idempotent_tests::unique("run"));
    let counter: State<u64> = State::new(store.clone(), scope.clone());
    for _ in 0..2 {
        let value: u64 = ctx
            .step("count")
            .run(&1, |_| {
                let counter = counter.clone();
                async move { counter.update(|n| Ok::<_, Error>(n.unwrap_or(0) + 1)).await.map(|updated| updated.value) }
            })
            .await
            .unwrap();
        assert_eq!(value, 1, "the step replays, and the state was bumped once");
    }
    let again: State<u64> = State::new(store, scope);
    assert_eq!(again.load().await.unwrap().value, Some(1), "a second handle on the same store sees the state");
}

/// A store of another type behind a `SharedStore` keeps no states: `State` says so, at its first
/// use, instead of losing or inventing them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_keeps_no_states_says_so() {
    let custom: SharedStore = Arc::new(HookedStore::new(Arc::new(MemoryStore::new())));
    let state: State<u64> = State::new(custom, fresh_scope("none"));
    let err = state.load().await.unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert!(err.to_string().contains("keeps no versioned states"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_state_conforms() {
    run_all(Arc::new(MemoryStateStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_state_conforms() {
    let server = RedisServer::start();
    let store = RedisStore::connect_lazy(server.url()).unwrap();
    run_all(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_state_conforms() {
    let cluster = RedisCluster::start();
    let store = RedisStore::cluster_builder(cluster.urls()).connect_lazy().unwrap();
    run_all(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_state_conforms() {
    let dir = tempfile::TempDir::new().unwrap();
    let store = SqliteStore::connect(dir.path().join("state.db")).await.unwrap();
    run_all(Arc::new(store.clone())).await;
    // Created once, registered, and left alone by a second migration.
    store.migrate_state().await.unwrap();
    let version: i64 =
        sqlx::query_scalar("SELECT version FROM idempotent_schema WHERE name = 'idempotent_records_state'")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(version, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_state_conforms() {
    let server = PgServer::start();
    let store = PostgresStore::builder(server.url()).max_connections(16).connect().await.unwrap();
    run_all(Arc::new(store.clone())).await;
    store.migrate_state().await.unwrap();
}

/// A table of the state table's name that this crate did not create is refused, not altered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_state_table_is_refused() {
    let dir = tempfile::TempDir::new().unwrap();
    let store = SqliteStore::connect(dir.path().join("state.db")).await.unwrap();
    sqlx::query("CREATE TABLE idempotent_records_state (x INTEGER)").execute(store.pool()).await.unwrap();
    let state: State<u64> = State::new(store.clone(), fresh_scope("foreign"));
    let err = state.load().await.unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err:?}");
    assert!(err.to_string().contains("was not created by idempotent-core"), "{err}");
}

/// 32 × 25 updates through a proxy that loses 20% of Redis's replies: no update is lost or
/// applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_counter_is_exact_when_replies_are_lost() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", server.port()).parse().unwrap()).await;
    let store = RedisStore::connect_lazy(proxy.url()).unwrap();
    proxy.set(Fault::DropSomeReplies { percent: 20 });
    let store: SharedStateStore = Arc::new(store);
    // 32 writers of 25 updates: enough contention and lost replies (about 20% of the commits') to
    // exercise every retry path, in seconds rather than minutes.
    assert_eq!(counter(&store, 32, 25).await, 800);
}

/// The same on PostgreSQL, its replies lost by the proxy: 64 tasks × 10 updates. (Commits on one
/// row are serial and each waits for its fsync, and every lost reply costs a new connection
/// through the proxy, so the full 64 × 100 takes tens of minutes on a loaded 2-core machine;
/// `postgres_state_conforms` runs the full count without the proxy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_counter_is_exact_when_replies_are_lost() {
    let server = PgServer::start();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", server.port()).parse().unwrap()).await;
    let url = format!("postgres://postgres@{}/postgres", proxy.addr());
    // A lost reply costs the call its timeout: a short one keeps the test short.
    let store =
        PostgresStore::builder(url).max_connections(16).timeout(Duration::from_millis(500)).connect().await.unwrap();
    store.migrate_state().await.unwrap();
    proxy.set(Fault::DropSomeReplies { percent: 20 });
    let store: SharedStateStore = Arc::new(store);
    // 16 writers of 10 updates: every lost reply costs a call the 500 ms timeout, so more writers
    // only make the test longer, not the contention different.
    assert_eq!(counter(&store, 16, 10).await, 160);
}

/// A step whose action merges its result into a thread's state, whose record's completion is
/// lost: the retry runs the action again (recovered), and its update replays instead of
/// appending a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_retried_after_a_lost_completion_merges_once() {
    let lost = Arc::new(AtomicU32::new(1));
    let flag = lost.clone();
    let records: SharedStore = Arc::new(HookedStore::new(Arc::new(MemoryStore::new())).on_complete(move |call| {
        let flag = flag.clone();
        Box::pin(async move {
            if flag.fetch_sub(1, Ordering::SeqCst) == 1 {
                return Err(Error::Unavailable {
                    store: "memory".into(),
                    op: "complete",
                    reason: "the store went away".into(),
                    source: None,
                });
            }
            call.forward().await
        })
    }));
    let thread: State<Vec<String>> = State::new(MemoryStateStore::new(), fresh_scope("thread"));
    let ctx = RunContext::new(records, "thread-1");
    let runs = AtomicU32::new(0);
    let mut replays = Vec::new();
    for _ in 0..2 {
        let out = ctx
            .step("search")
            .run(&"occ", |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                let merged = thread.modify(|findings| findings.push("finding".into())).await?;
                Ok::<_, Error>(merged.replayed)
            })
            .await;
        replays.push(out.map_err(|e| e.to_string()));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the lost completion makes the step run again");
    assert!(replays[0].is_err(), "the first call reports the lost completion: {replays:?}");
    assert_eq!(replays[1], Ok(true), "the second run's update replays the first's");
    assert_eq!(thread.load().await.unwrap().value.unwrap(), ["finding"]);
}

/// Four branches of an agent run, each a sequence of steps, append their findings to one state
/// on Redis behind a proxy losing 20% of replies (records and state alike); each branch retries
/// a failed step. Every finding appears exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_branches_append_each_finding_once() {
    // Three times the store's command timeout (2 s), as `StepOptions::lease` advises.
    const LEASE: Duration = Duration::from_secs(6);
    let server = RedisServer::start();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", server.port()).parse().unwrap()).await;
    let store = RedisStore::connect_lazy(proxy.url()).unwrap();
    proxy.set(Fault::DropSomeReplies { percent: 20 });
    let scope = fresh_scope("findings");
    let (branches, per_branch) = (4, 25);
    let failures = Arc::new(AtomicU32::new(0));
    let tasks = (0..branches).map(|b| {
        let ctx = RunContext::new(store.clone(), "agent-run-7");
        let findings: State<Vec<String>> = State::new(store.clone(), scope.clone()).policy(patient());
        let failures = failures.clone();
        tokio::spawn(async move {
            for i in 0..per_branch {
                let finding = format!("branch {b}: finding {i}");
                let (mut tries, started) = (0, std::time::Instant::now());
                loop {
                    let found = finding.clone();
                    let res = ctx
                        .step("investigate")
                        // An acquire whose reply and whose release were both lost holds the key
                        // for its lease: the branch's retries outlast a few.
                        .lease(LEASE)
                        .run(&(b, i), |_| async {
                            let appended = findings.update(|all| {
                                let mut all = all.unwrap_or_default();
                                all.push(found.clone());
                                Ok::<_, Error>(all)
                            });
                            appended.await.map(|u| u.version.get())
                        })
                        .await;
                    match res {
                        Ok(_) => break,
                        Err(e) if e.is_transient() && started.elapsed() < 4 * LEASE => {
                            // The branch's own retry, with the crate's backoff (an acquire whose
                            // reply was lost holds the key until the store releases it).
                            let backoff = Backoff::new(Duration::from_millis(5), Duration::from_millis(200));
                            tokio::time::sleep(backoff.ceiling(tries.min(6)) / 2).await;
                            tries += 1;
                            failures.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(e) => panic!("branch {b} finding {i}: {e}"),
                    }
                }
            }
        })
    });
    for t in join_all(tasks).await {
        t.unwrap();
    }
    proxy.set(Fault::Pass);
    let findings: State<Vec<String>> = State::new(store.clone(), scope);
    let all = findings.load().await.unwrap().value.unwrap();
    let mut counts = BTreeMap::new();
    for f in &all {
        *counts.entry(f.clone()).or_insert(0) += 1;
    }
    assert_eq!(counts.len(), branches * per_branch, "missing findings");
    assert!(counts.values().all(|&n| n == 1), "findings appended more than once: {counts:?}");
    assert!(failures.load(Ordering::SeqCst) > 0, "the transport lost nothing: the test proved nothing");
}

/// The shared cart's routes (`idempotent_examples::cart`): `ETag` from the version, `If-Match`
/// required (428), a stale tag refused with the current `ETag` (412), both problem documents, and
/// a `PUT` retried under its `Idempotency-Key` after its reply was lost recognised as applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cart_routes_check_if_match() {
    use axum::body::Body;
    use http::{Request, StatusCode, header};
    use http_body_util::BodyExt;
    use idempotent_core::state::Scope;
    use tower::ServiceExt;

    let cart: Arc<idempotent_examples::cart::Cart> = Arc::new(State::new(MemoryStateStore::new(), Scope::new("cart")));
    let app = idempotent_examples::cart::router(cart.clone());
    let call = |req: Request<Body>| {
        let app = app.clone();
        async move {
            let res = app.oneshot(req).await.unwrap();
            let (parts, body) = res.into_parts();
            (parts.status, parts.headers, body.collect().await.unwrap().to_bytes())
        }
    };
    let put = |tag: Option<&str>, key: &str, items: &str| {
        let mut req = Request::put("/cart").header("content-type", "application/json").header("idempotency-key", key);
        if let Some(tag) = tag {
            req = req.header(header::IF_MATCH, tag);
        }
        req.body(Body::from(items.to_owned())).unwrap()
    };

    let (status, headers, body) = call(Request::get("/cart").body(Body::empty()).unwrap()).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"[]"[..]));
    let absent = headers[header::ETAG].to_str().unwrap().to_owned();

    let (status, headers, body) = call(put(None, "k0", r#"["tea"]"#)).await;
    assert_eq!(status, StatusCode::PRECONDITION_REQUIRED, "{body:?}");
    assert_eq!(headers[header::CONTENT_TYPE], "application/problem+json");
    assert!(String::from_utf8_lossy(&body).contains("If-Match"), "{body:?}");

    let (status, headers, _) = call(put(Some(&absent), "k1", r#"["tea"]"#)).await;
    assert_eq!(status, StatusCode::OK);
    let first = headers[header::ETAG].to_str().unwrap().to_owned();
    assert_ne!(first, absent);

    // Another writer's tag is stale now: 412, with the current tag to re-read by.
    let (status, headers, body) = call(put(Some(&absent), "k2", r#"["coffee"]"#)).await;
    assert_eq!(status, StatusCode::PRECONDITION_FAILED, "{body:?}");
    assert_eq!(headers[header::CONTENT_TYPE], "application/problem+json");
    assert_eq!(headers[header::ETAG].to_str().unwrap(), first);

    // The first PUT again (its reply was lost): its tag is stale by its own write, yet its key
    // names the commit that went in, so it is answered as applied and applies nothing.
    let (status, _, _) = call(put(Some(&absent), "k1", r#"["tea"]"#)).await;
    assert_eq!(status, StatusCode::OK, "a retried PUT is recognised, not refused");
    assert_eq!(cart.load().await.unwrap().value, Some(vec!["tea".to_owned()]));
    assert_eq!(cart.load().await.unwrap().version.get(), 1, "one commit");
}
