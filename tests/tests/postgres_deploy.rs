//! Where production PostgreSQL stores live: over TLS (`sslmode`, `sslrootcert`), in a schema of
//! their own (`PostgresStoreBuilder::schema`, `?schema=`), and what opening a store on a
//! database nobody answers for says. Each test runs throwaway servers of its own. PgBouncer is
//! in `pgbouncer.rs`.

use std::time::{Duration, Instant};

use idempotent_core::sqlx::PgTransaction;
use idempotent_core::{Error, PostgresStore, RunContext, Store};
use idempotent_tests::PgServer;
use idempotent_tests::sql_store::{KEEP, LEASE, acquired, key};

/// Runs one step on `store` and answers its result.
async fn one_step(store: &PostgresStore, run: &str) -> String {
    let ctx = RunContext::new(store.clone(), run);
    ctx.step("charge")
        .run(&(run, 1500), |attempt| async move { Ok::<_, Error>(format!("ch_{}", attempt.fence())) })
        .await
        .unwrap()
}

/// Whether the store's connections are encrypted (PostgreSQL's own view of one of them).
async fn over_tls(store: &PostgresStore) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

fn tls_url(server: &PgServer, host: &str, mode: &str, ca: Option<&std::path::Path>) -> String {
    let mut url = format!("postgres://postgres@{host}:{}/postgres?sslmode={mode}", server.port());
    if let Some(ca) = ca {
        url.push_str(&format!("&sslrootcert={}", ca.display()));
    }
    url
}

/// The store's [`Error::Unavailable`] reason for `url`, which must come well within the
/// timeout (a refusal, not a wait).
async fn refused(url: &str) -> String {
    let started = Instant::now();
    let res = PostgresStore::builder(url).timeout(Duration::from_secs(5)).connect().await;
    let elapsed = started.elapsed();
    match res {
        Err(Error::Unavailable { op: "open", reason, .. }) => {
            assert!(elapsed < Duration::from_secs(2), "refused after {elapsed:?}");
            reason
        }
        other => panic!("{url}: expected Unavailable, got {other:?} after {elapsed:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_the_servers_ca_connects_over_tls_and_runs_a_step() {
    let server = PgServer::start_tls();
    let url = tls_url(&server, "localhost", "verify-full", Some(&server.tls().ca));
    let store = PostgresStore::connect(&url).await.unwrap_or_else(|e| panic!("{e}; log:\n{}", server.log()));
    assert!(over_tls(&store).await, "the store's connection is not encrypted");
    let first = one_step(&store, "tls-order").await;
    assert_eq!(one_step(&store, "tls-order").await, first, "the step ran twice");
    // The address the certificate names works as well as its host name.
    let by_ip = tls_url(&server, "127.0.0.1", "verify-full", Some(&server.tls().ca));
    assert!(over_tls(&PostgresStore::connect(by_ip).await.unwrap()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_connects_over_tls_without_checking_the_certificate() {
    let server = PgServer::start_tls();
    let store = PostgresStore::connect(tls_url(&server, "127.0.0.2", "require", None)).await.unwrap();
    assert!(over_tls(&store).await, "sslmode=require made a plain connection");
    one_step(&store, "require-order").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_of_another_ca_is_refused_as_one() {
    let server = PgServer::start_tls();
    for mode in ["verify-ca", "verify-full"] {
        let reason = refused(&tls_url(&server, "localhost", mode, Some(&server.tls().wrong_ca))).await;
        assert!(reason.contains("certificate is not signed by a CA this client trusts"), "{mode}: {reason}");
        assert!(reason.contains("sslrootcert"), "{mode}: {reason}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_refuses_a_host_the_certificate_does_not_name() {
    let server = PgServer::start_tls();
    let reason = refused(&tls_url(&server, "127.0.0.2", "verify-full", Some(&server.tls().ca))).await;
    assert!(reason.contains("not valid for the host name in the URL"), "{reason}");
    // verify-ca checks the CA only.
    let store = PostgresStore::connect(tls_url(&server, "127.0.0.2", "verify-ca", Some(&server.tls().ca))).await;
    assert!(over_tls(&store.unwrap()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_nobody_listens_on_is_unavailable_at_once_with_the_refusal() {
    let port = idempotent_tests::free_port(false);
    let started = Instant::now();
    let reason = refused(&format!("postgres://app:secret@127.0.0.1:{port}/app")).await;
    println!("refused in {:?}: {reason}", started.elapsed());
    assert!(reason.to_lowercase().contains("connection refused"), "{reason}");
    assert!(!reason.contains("secret"), "{reason}");
}

/// A database that goes away under an open store: every call fails closed at once, as a store
/// failure, and once the pool holds no connection the error says the database refused (the
/// pool alone would retry the refusal for the whole timeout and report only that it ran out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_gone_under_an_open_store_is_unavailable_at_once() {
    let mut server = PgServer::start();
    let store = PostgresStore::builder(server.url()).timeout(Duration::from_secs(5)).connect().await.unwrap();
    let ctx = RunContext::new(store, "gone");
    let v: u8 = ctx.step("s").run(&1, |_| async { Ok::<_, Error>(1) }).await.unwrap();
    assert_eq!(v, 1);
    server.kill9();
    let mut refused = false;
    for i in 2..8u8 {
        let started = Instant::now();
        let err = ctx.step("s").run(&i, |_| async move { Ok::<_, Error>(i) }).await.unwrap_err();
        let took = started.elapsed();
        assert!(matches!(err, Error::Unavailable { .. }), "call {i}: {err} after {took:?}");
        assert!(took < Duration::from_secs(2), "call {i} took {took:?} of its 5 s timeout: {err}");
        refused |= err.to_string().to_lowercase().contains("connection refused");
    }
    assert!(refused, "no call said that the database refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_in_two_schemas_of_one_database_keep_separate_records() {
    let server = PgServer::start();
    let payments = PostgresStore::builder(server.url()).schema("payments").connect().await.unwrap();
    // The URL's `?schema=` (what the CLI and `store::connect` read) does the same.
    let refunds = PostgresStore::connect(format!("{}?schema=refunds", server.url())).await.unwrap();
    let k = key(7);
    let taken = acquired(&payments, &k, LEASE).await;
    payments.complete(&k, &taken.token, bytes::Bytes::from_static(b"paid"), KEEP).await.unwrap();
    // The same key is new in the other schema, and still done in the first.
    let other = acquired(&refunds, &k, LEASE).await;
    assert_eq!(other.attempt.number(), 1);
    let again = PostgresStore::builder(server.url()).schema("payments").connect().await.unwrap();
    let answer = again.acquire(&k, &idempotent_tests::sql_store::FP, LEASE, KEEP).await.unwrap();
    assert!(matches!(answer, idempotent_core::record::Acquire::Replay(_)), "{answer:?}");

    let mut conn = server.connection().await;
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT schemaname || '.' || tablename FROM pg_tables WHERE tablename LIKE 'idempotent%' ORDER BY 1",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        tables,
        [
            "payments.idempotent_records",
            "payments.idempotent_schema",
            "refunds.idempotent_records",
            "refunds.idempotent_schema"
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_in_a_transaction_commits_with_its_record_in_the_schema() {
    let server = PgServer::start();
    let mut conn = server.connection().await;
    sqlx::raw_sql("CREATE TABLE invoices (order_id text PRIMARY KEY, fence bigint NOT NULL)")
        .execute(&mut conn)
        .await
        .unwrap();
    let store = PostgresStore::builder(server.url()).schema("payments").connect().await.unwrap();
    let ctx = RunContext::new(store.clone(), "order-3");
    for _ in 0..2 {
        let fence = ctx
            .step("invoice")
            .run_in_transaction(&"order-3", async |tx: &mut PgTransaction<'_>, attempt| {
                // The application's table, in its own schema (the connection's search_path).
                sqlx::query("INSERT INTO invoices (order_id, fence) VALUES ($1, $2)")
                    .bind("order-3")
                    .bind(attempt.fence() as i64)
                    .execute(&mut **tx)
                    .await
                    .map_err(|e| Error::Config(e.to_string()))?;
                Ok::<_, Error>(attempt.fence())
            })
            .await
            .unwrap();
        assert!(fence > 0);
    }
    let invoices: i64 = sqlx::query_scalar("SELECT count(*) FROM public.invoices").fetch_one(&mut conn).await.unwrap();
    let done: i64 = sqlx::query_scalar("SELECT count(*) FROM payments.idempotent_records WHERE state = 'done'")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!((invoices, done), (1, 1), "the step ran twice, or its record is not in the schema");

    // The state table goes to the schema too.
    let counter: idempotent_core::state::State<u64> =
        idempotent_core::state::State::new(store.clone(), idempotent_tests::state::fresh_scope("schema"));
    counter.update(|n| Ok::<_, Error>(n.unwrap_or(0) + 1)).await.unwrap();
    let state: Option<String> = sqlx::query_scalar("SELECT to_regclass('payments.idempotent_records_state')::text")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(state.as_deref(), Some("payments.idempotent_records_state"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_name_that_is_not_an_identifier_is_refused_before_connecting() {
    // Nobody listens there: a refusal would be Unavailable, not Config.
    let url = format!("postgres://postgres@127.0.0.1:{}/x", idempotent_tests::free_port(false));
    for bad in ["a.b", "pg_temp", "x\"; DROP SCHEMA public; --"] {
        let res = PostgresStore::builder(&url).schema(bad).connect().await;
        let Err(Error::Config(msg)) = res else { panic!("{bad}: {res:?}") };
        assert!(msg.contains("schema name"), "{msg}");
    }
    let res = PostgresStore::connect(format!("{url}?schema=1x")).await;
    assert!(matches!(res, Err(Error::Config(_))), "{res:?}");
}
