//! Steps that commit with their record (`Step::run_in_transaction`, `#[idempotent(transaction =
//! ..)]`) on SQLite files in temporary directories: the business rows and the `done` record
//! commit together or not at all, whatever fails, whoever races, and wherever the process dies.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::{Extension, State};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idempotent_core::sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use idempotent_core::sqlx::{self, SqliteTransaction};
use idempotent_core::{Error, FailMode, IntoSharedStore, MemoryStore, OnInFlight, RunContext, SqliteStore, idempotent};
use idempotent_tests::HookedStore;
use idempotent_tests::txn::{InvoiceError, db, kill_child_before_commit};
use idempotent_tower::server::{IDEMPOTENT_STORED, IdempotencyLayer};
use tempfile::TempDir;
use tokio::sync::{Notify, Semaphore};
use tower::ServiceExt;

/// A store on a new file with the business table `invoices (order_id, fence)`.
async fn setup(name: &str) -> (TempDir, PathBuf, SqliteStore) {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join(name);
    let store = SqliteStore::open(&path).await.unwrap();
    create_invoices(&store).await;
    (dir, path, store)
}

async fn create_invoices(store: &SqliteStore) {
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS invoices (order_id TEXT NOT NULL, fence INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
}

async fn invoices(store: &SqliteStore) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT order_id, fence FROM invoices ORDER BY rowid").fetch_all(store.pool()).await.unwrap()
}

/// The state of the one record in the store's table.
async fn record_state(store: &SqliteStore) -> String {
    sqlx::query_scalar("SELECT state FROM idempotent_records").fetch_one(store.pool()).await.unwrap()
}

async fn insert(tx: &mut SqliteTransaction<'_>, order_id: &str, fence: u64) -> Result<(), Error> {
    sqlx::query("INSERT INTO invoices (order_id, fence) VALUES (?1, ?2)")
        .bind(order_id)
        .bind(fence as i64)
        .execute(&mut **tx)
        .await
        .map_err(db)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn business_rows_and_the_done_record_commit_together_and_replay() {
    let (_dir, _path, store) = setup("together.db").await;
    // Through a shared handle: the executor finds the SqliteStore behind the `Arc<dyn Store>`.
    let ctx = RunContext::new(store.clone().into_shared(), "order-7");
    let runs = AtomicU32::new(0);
    for _call in 0..3 {
        let fence: u64 = ctx
            .step("create_invoice")
            .run_in_transaction(&("order-7", 1500), async |tx: &mut SqliteTransaction<'_>, attempt| {
                runs.fetch_add(1, Ordering::SeqCst);
                assert_eq!(idempotent_core::current_attempt().as_ref(), Some(&attempt));
                insert(tx, "order-7", attempt.fence()).await?;
                Ok::<_, Error>(attempt.fence())
            })
            .await
            .unwrap();
        assert_eq!(invoices(&store).await, [("order-7".to_owned(), fence as i64)]);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the later calls replayed");
    assert_eq!(record_state(&store).await, "done");
    // Acquire and complete for the first call, acquire alone for each replay.
    assert_eq!(store.statements(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_error_rolls_back_its_writes_and_frees_the_key() {
    let (_dir, _path, store) = setup("error.db").await;
    let ctx = RunContext::new(store.clone(), "order-8");
    let step = || ctx.step("create_invoice");
    let failed: Result<u64, InvoiceError> = step()
        .run_in_transaction(&"order-8", async |tx: &mut SqliteTransaction<'_>, attempt| {
            insert(tx, "order-8", attempt.fence()).await?;
            Err(InvoiceError::Declined)
        })
        .await;
    assert!(matches!(failed, Err(InvoiceError::Declined)), "{failed:?}");
    assert_eq!(invoices(&store).await, []);
    assert_eq!(record_state(&store).await, "released");

    let fence = step()
        .run_in_transaction(&"order-8", async |tx: &mut SqliteTransaction<'_>, attempt| {
            assert_eq!(attempt.number(), 2);
            assert!(!attempt.recovered(), "the first attempt released the key");
            insert(tx, "order-8", attempt.fence()).await?;
            Ok::<_, InvoiceError>(attempt.fence())
        })
        .await
        .unwrap();
    assert_eq!(invoices(&store).await, [("order-8".to_owned(), fence as i64)]);
    assert_eq!(record_state(&store).await, "done");
}

/// Holds the connection a pool hands out after `pass` more hand-outs, until released: lets a
/// test stop a step between its acquire and its `BEGIN IMMEDIATE`.
struct Gate {
    pass: AtomicU32,
    armed: std::sync::atomic::AtomicBool,
    holding: Notify,
    open: Semaphore,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_taken_over_before_the_commit_rolls_the_loser_back() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("lost.db");
    let winner_store = SqliteStore::open(&path).await.unwrap();
    create_invoices(&winner_store).await;

    // The loser's store is on a pool of one connection whose hand-outs the gate can hold.
    let gate = Arc::new(Gate {
        pass: AtomicU32::new(0),
        armed: std::sync::atomic::AtomicBool::new(false),
        holding: Notify::new(),
        open: Semaphore::new(0),
    });
    let hook = gate.clone();
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .before_acquire(move |_conn, _meta| {
            let gate = hook.clone();
            Box::pin(async move {
                if gate.armed.load(Ordering::SeqCst) && gate.pass.fetch_sub(1, Ordering::SeqCst) == 0 {
                    gate.armed.store(false, Ordering::SeqCst);
                    gate.holding.notify_one();
                    gate.open.acquire().await.unwrap().forget();
                }
                Ok(true)
            })
        })
        .connect_with(SqliteConnectOptions::new().filename(&path).journal_mode(SqliteJournalMode::Wal))
        .await
        .unwrap();
    let loser_store = SqliteStore::from_pool(pool, "idempotent_records").await.unwrap();

    // The loser's acquire (its upsert, as a new store writes first: one hand-out) passes the
    // gate; its `begin` is held there.
    gate.pass.store(1, Ordering::SeqCst);
    gate.armed.store(true, Ordering::SeqCst);
    let loser_ctx = RunContext::new(loser_store.clone(), "order-9");
    let loser = tokio::spawn(async move {
        loser_ctx
            .step("create_invoice")
            .lease(Duration::from_millis(200))
            .heartbeat(false)
            .run_in_transaction(&"order-9", async |tx: &mut SqliteTransaction<'_>, attempt| {
                insert(tx, "loser", attempt.fence()).await?;
                Ok::<_, Error>(attempt.fence())
            })
            .await
    });
    gate.holding.notified().await;
    assert_eq!(record_state(&winner_store).await, "running", "the loser holds the key");

    // Another attempt waits for the loser's lease to run out, takes the key over and commits.
    let winner_ctx = RunContext::new(winner_store.clone(), "order-9");
    let winner_fence = winner_ctx
        .step("create_invoice")
        .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(30) })
        .run_in_transaction(&"order-9", async |tx: &mut SqliteTransaction<'_>, attempt| {
            assert!(attempt.recovered(), "the loser's lease ran out without an outcome");
            insert(tx, "winner", attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await
        .unwrap();

    gate.open.add_permits(1);
    let lost = loser.await.unwrap();
    let Err(Error::LeaseLost { fence, .. }) = lost else { panic!("the loser stored its outcome: {lost:?}") };
    assert!(fence < winner_fence, "the winner's fence {winner_fence} is above the loser's {fence}");
    assert_eq!(invoices(&winner_store).await, [("winner".to_owned(), winner_fence as i64)]);
    assert_eq!(record_state(&winner_store).await, "done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_rolls_back_and_frees_the_key() {
    let (_dir, _path, store) = setup("commit.db").await;
    sqlx::raw_sql(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY);\n\
         CREATE TABLE orders (id TEXT NOT NULL, customer INTEGER NOT NULL\n\
           REFERENCES customers(id) DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let ctx = RunContext::new(store.clone(), "order-10");
    let place = || {
        ctx.step("place_order").run_in_transaction(&"order-10", async |tx: &mut SqliteTransaction<'_>, attempt| {
            // Customer 42 does not exist: the deferred foreign key fails the commit, not this insert.
            sqlx::query("INSERT INTO orders (id, customer) VALUES ('order-10', 42)")
                .execute(&mut **tx)
                .await
                .map_err(db)?;
            Ok::<_, Error>(attempt.number())
        })
    };
    let failed = place().await;
    let Err(e @ Error::Unavailable { op: "commit", .. }) = failed else { panic!("{failed:?}") };
    assert!(e.to_string().contains("FOREIGN KEY"), "{e}");
    assert!(e.to_string().contains("the key was released"), "{e}");
    let orders = || sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders").fetch_one(store.pool());
    assert_eq!(orders().await.unwrap(), 0);
    assert_eq!(record_state(&store).await, "released");

    sqlx::query("INSERT INTO customers (id) VALUES (42)").execute(store.pool()).await.unwrap();
    assert_eq!(place().await.unwrap(), 2, "the retry ran as the second attempt");
    assert_eq!(orders().await.unwrap(), 1);
    assert_eq!(record_state(&store).await, "done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_insert_one_row() {
    let (_dir, _path, store) = setup("race.db").await;
    let runs = Arc::new(AtomicU32::new(0));
    let mut calls = Vec::new();
    for _ in 0..16 {
        let ctx = RunContext::new(store.clone(), "order-11");
        let runs = runs.clone();
        calls.push(tokio::spawn(async move {
            ctx.step("create_invoice")
                .run_in_transaction(&"order-11", async |tx: &mut SqliteTransaction<'_>, attempt| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    insert(tx, "order-11", attempt.fence()).await?;
                    Ok::<_, Error>(attempt.fence())
                })
                .await
        }));
    }
    let mut fences = Vec::new();
    for call in calls {
        fences.push(call.await.unwrap().unwrap());
    }
    assert!(fences.iter().all(|&f| f == fences[0]), "every caller got the first result: {fences:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(invoices(&store).await, [("order-11".to_owned(), fences[0] as i64)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_rolls_back_and_the_retry_runs_at_once() {
    let (_dir, _path, store) = setup("cancel.db").await;
    let ctx = RunContext::new(store.clone(), "order-12");
    let inserted = Notify::new();
    let call =
        ctx.step("create_invoice").run_in_transaction(&"order-12", async |tx: &mut SqliteTransaction<'_>, attempt| {
            insert(tx, "order-12", attempt.fence()).await?;
            inserted.notify_one();
            std::future::pending::<()>().await;
            Ok::<_, Error>(attempt.fence())
        });
    tokio::select! {
        out = call => panic!("the action never returns, yet the call ended with {out:?}"),
        () = inserted.notified() => {}
    }
    // The call was dropped mid-action: its transaction rolled back.
    assert_eq!(invoices(&store).await, []);

    let fence = ctx
        .step("create_invoice")
        .run_in_transaction(&"order-12", async |tx: &mut SqliteTransaction<'_>, attempt| {
            assert_eq!(attempt.number(), 2);
            assert!(!attempt.recovered(), "the cancelled call released the key");
            insert(tx, "order-12", attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await
        .unwrap();
    assert_eq!(invoices(&store).await, [("order-12".to_owned(), fence as i64)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_before_its_commit_leaves_nothing_and_the_retry_recovers() {
    let (_dir, path, store) = setup("crash.db").await;
    let url = format!("sqlite://{}", path.display());
    let child_fence = kill_child_before_commit(env!("CARGO_BIN_EXE_txn_child"), &url, 300).await;
    assert_eq!(invoices(&store).await, []);
    assert_eq!(record_state(&store).await, "running", "no done record: the key is the dead child's");

    let ctx = RunContext::new(store.clone(), "crash-run");
    let fence = ctx
        .step("create_invoice")
        .run_in_transaction(&"order-1", async |tx: &mut SqliteTransaction<'_>, attempt| {
            assert!(attempt.recovered(), "the child's lease ran out without an outcome");
            insert(tx, "order-1", attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await
        .unwrap();
    assert!(fence > child_fence);
    assert_eq!(invoices(&store).await, [("order-1".to_owned(), fence as i64)]);
    assert_eq!(record_state(&store).await, "done");
}

#[tokio::test]
async fn a_store_of_another_kind_is_a_config_error() {
    let ctx = RunContext::new(MemoryStore::new(), "order-13");
    let runs = AtomicU32::new(0);
    let out = ctx
        .step("create_invoice")
        .run_in_transaction(&"order-13", async |_tx: &mut SqliteTransaction<'_>, _| {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(0)
        })
        .await;
    let Err(Error::Config(message)) = out else { panic!("{out:?}") };
    assert!(message.contains("step `create_invoice`"), "{message}");
    assert!(message.contains("needs the run context's store to be a SqliteStore"), "{message}");
    assert!(message.contains("but it is memory"), "{message}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_wrapper_around_a_sqlite_store_is_a_config_error() {
    let (_dir, _path, store) = setup("wrapped.db").await;
    let wrapped = HookedStore::new(store.clone().into_shared()).describe_as(|inner| format!("hooked {inner}"));
    let ctx = RunContext::new(wrapped, "order-13");
    let out = ctx
        .step("create_invoice")
        .run_in_transaction(&"order-13", async |tx: &mut SqliteTransaction<'_>, attempt| {
            insert(tx, "order-13", attempt.fence()).await?;
            Ok::<_, Error>(0)
        })
        .await;
    let Err(Error::Config(message)) = out else { panic!("{out:?}") };
    assert!(message.contains("but it is hooked sqlite://"), "{message}");
    assert!(message.contains("not a wrapper around it"), "{message}");
    assert_eq!(invoices(&store).await, []);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_open_runs_the_action_in_a_transaction_of_its_own() {
    let (_dir, _path, store) = setup("open.db").await;
    // The records' table is gone: every acquire fails (a store failure), while the database
    // still takes the action's writes.
    sqlx::raw_sql("DROP TABLE idempotent_records").execute(store.pool()).await.unwrap();
    let ctx = RunContext::new(store.clone(), "order-17");
    let call = |mode| {
        ctx.step("create_invoice").fail_mode(mode).run_in_transaction(
            &"order-17",
            async |tx: &mut SqliteTransaction<'_>, attempt| {
                assert!(attempt.is_unprotected());
                insert(tx, "order-17", attempt.fence()).await?;
                Ok::<_, Error>(attempt.fence())
            },
        )
    };
    let closed = call(FailMode::Closed).await;
    assert!(matches!(closed, Err(Error::Unavailable { op: "acquire", .. })), "{closed:?}");
    assert_eq!(invoices(&store).await, []);
    assert_eq!(call(FailMode::Open).await.unwrap(), 0, "the unprotected attempt's fence is 0");
    assert_eq!(invoices(&store).await, [("order-17".to_owned(), 0)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_call_is_send_and_can_be_spawned() {
    let (_dir, _path, store) = setup("send.db").await;
    let ctx = RunContext::new(store.clone(), "order-14");
    let call = tokio::spawn(async move {
        ctx.step("create_invoice")
            .run_in_transaction(&"order-14".to_owned(), async |tx: &mut SqliteTransaction<'_>, attempt| {
                insert(tx, "order-14", attempt.fence()).await?;
                tokio::task::yield_now().await;
                Ok::<_, Error>(attempt.fence())
            })
            .await
    });
    let fence = call.await.unwrap().unwrap();
    assert_eq!(invoices(&store).await, [("order-14".to_owned(), fence as i64)]);
}

#[idempotent(step = "create_invoice", transaction = tx)]
async fn create_invoice(ctx: &RunContext, tx: &mut SqliteTransaction<'_>, order_id: &str) -> Result<u64, Error> {
    let fence = idempotent_core::current_attempt().expect("inside a step").fence();
    insert(tx, order_id, fence).await?;
    Ok(fence)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_macro_commits_the_body_with_the_record_and_replays() {
    let (_dir, _path, store) = setup("macro.db").await;
    let ctx = RunContext::new(store.clone(), "order-15");
    let first = create_invoice(&ctx, "order-15").await.unwrap();
    let again = create_invoice(&ctx, "order-15").await.unwrap();
    assert_eq!(first, again);
    assert_eq!(invoices(&store).await, [("order-15".to_owned(), first as i64)]);
    // The generated function's future is Send too.
    let spawned = tokio::spawn(async move { create_invoice(&ctx, "order-16").await }).await.unwrap().unwrap();
    assert!(spawned > 0);
    assert_eq!(invoices(&store).await.len(), 2);
}

type Shared = (SqliteStore, Arc<AtomicU32>);

/// A handler whose database write is a step in the request's run context, as the layer's docs
/// say (on the database's store: the layer's is a wrapper around it).
async fn create_invoice_handler(
    State((db, runs)): State<Shared>,
    Extension(ctx): Extension<RunContext>,
    order: String,
) -> (StatusCode, String) {
    runs.fetch_add(1, Ordering::SeqCst);
    let invoice = ctx
        .with_store(db.clone())
        .step("create_invoice")
        .run_in_transaction(&order, async |tx: &mut SqliteTransaction<'_>, attempt| {
            insert(tx, &order, attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
        .await;
    match invoice {
        Ok(fence) => (StatusCode::CREATED, format!("invoice {fence}")),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_response_the_layer_could_not_store_is_rebuilt_without_writing_twice() {
    let (_dir, _path, store) = setup("http.db").await;
    // The layer's store (the same file) fails to store the first response, as if the server
    // had died between the handler's commit and the layer's `complete`.
    let layer_store = HookedStore::with_state(store.clone().into_shared(), AtomicU32::new(1)).on_complete(|call| {
        Box::pin(async move {
            if call.store.state().swap(0, Ordering::SeqCst) == 1 {
                return Err(Error::Unavailable {
                    store: "test".into(),
                    op: "complete",
                    reason: "injected".into(),
                    source: None,
                });
            }
            call.forward().await
        })
    });
    let runs = Arc::new(AtomicU32::new(0));
    let app =
        Router::new().route("/invoices", post(create_invoice_handler)).with_state((store.clone(), runs.clone())).layer(
            IdempotencyLayer::new(layer_store)
                .lease(Duration::from_millis(300))
                .on_in_flight(OnInFlight::Wait { timeout: Duration::from_secs(30) }),
        );
    let request = |key: &'static str| {
        Request::post("/invoices").header("idempotency-key", key).body(Body::from("order-20")).unwrap()
    };
    let body = |res: axum::response::Response| async move {
        String::from_utf8(to_bytes(res.into_body(), 1 << 20).await.unwrap().to_vec()).unwrap()
    };

    let first = app.clone().oneshot(request("\"k-20\"")).await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()[IDEMPOTENT_STORED], "false");
    let first = body(first).await;

    // The same key, bare: once the layer's lease has run out, the handler runs again, and its
    // step replays the invoice instead of inserting a second one.
    let retry = app.clone().oneshot(request("k-20")).await.unwrap();
    assert_eq!(retry.status(), 201);
    assert!(!retry.headers().contains_key(IDEMPOTENT_STORED), "the rebuilt response was stored");
    assert_eq!(body(retry).await, first);
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    let replayed = app.clone().oneshot(request("k-20")).await.unwrap();
    assert_eq!(replayed.headers()["idempotent-replayed"], "true");
    assert_eq!(body(replayed).await, first);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let fence: i64 = first.strip_prefix("invoice ").unwrap().parse().unwrap();
    assert_eq!(invoices(&store).await, [("order-20".to_owned(), fence)]);
}

/// A step whose record needs attention is refused before its transaction begins: the action is
/// not called and nothing is written; resolved as not done, the next call runs it. A completion
/// in a transaction by an attempt that was marked (uncertain, or needing attention) is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_record_needs_attention_is_refused_and_its_action_not_called() {
    use idempotent_core::record::{Abandon, Acquire, Resolved, Transition};
    use idempotent_core::store::TransactionalStore;
    use idempotent_core::{Key, Store};
    let (lease, keep) = (Duration::from_secs(10), Duration::from_secs(60));
    let (_dir, _path, store) = setup("attention.db").await;
    let ctx = RunContext::new(store.clone(), "order-9");
    let payload = ("order-9", 900);
    let (key, fp) = ctx.step("create_invoice").key_for(&payload).unwrap();
    let Acquire::Acquired(first) = store.acquire(&key, &fp, lease, keep).await.unwrap() else { panic!("taken") };
    assert_eq!(store.abandon(&key, &first.token, Abandon::NeedsAttention).await.unwrap(), Transition::Ok);
    let runs = AtomicU32::new(0);
    let call = || {
        ctx.step("create_invoice").run_in_transaction(&payload, async |tx: &mut SqliteTransaction<'_>, attempt| {
            runs.fetch_add(1, Ordering::SeqCst);
            insert(tx, "order-9", attempt.fence()).await?;
            Ok::<_, Error>(attempt.fence())
        })
    };
    let err = call().await.unwrap_err();
    assert!(
        matches!(err, Error::NeedsAttention { attempt: 1, fence, .. } if fence == first.attempt.fence()),
        "{err:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the action was called");
    assert_eq!(invoices(&store).await, []);
    assert_eq!(record_state(&store).await, "needs_attention");
    assert_eq!(ctx.step("create_invoice").resolve_not_done(&payload).await.unwrap(), Resolved::Ok);
    let fence = call().await.unwrap();
    assert!(fence > first.attempt.fence());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(invoices(&store).await, [("order-9".to_owned(), fence as i64)]);

    for (n, mark) in [Abandon::Uncertain, Abandon::NeedsAttention].into_iter().enumerate() {
        let key = Key::from_bytes([n as u8 + 1; 32]);
        let Acquire::Acquired(grant) = store.acquire(&key, &fp, lease, keep).await.unwrap() else { panic!("taken") };
        assert_eq!(store.abandon(&key, &grant.token, mark).await.unwrap(), Transition::Ok);
        let mut tx = store.begin().await.unwrap();
        let late = bytes::Bytes::from_static(b"late");
        assert_eq!(store.complete_in(&mut tx, &key, &grant.token, late, keep).await.unwrap(), Transition::LeaseLost);
        tx.commit().await.unwrap();
        match (mark, store.acquire(&key, &fp, lease, keep).await.unwrap()) {
            (Abandon::Uncertain, Acquire::Acquired(next)) => assert!(next.attempt.recovered(), "{mark:?}"),
            (Abandon::NeedsAttention, Acquire::NeedsAttention { attempt: 1, .. }) => {}
            (mark, other) => panic!("{mark:?}: then acquire answered {other:?}"),
        }
    }
}
