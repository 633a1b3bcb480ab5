//! The real `idempotent` binary against real stores the harness spawns: records are seeded
//! through the library, the command is run, and both its output and the store's state are
//! checked.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use idempotent_core::record::{Abandon, Acquire, Labels};
use idempotent_core::store::{Cursor, Filter, RecordState};
use idempotent_core::{Attempt, Error, Key, RunContext, SharedStore, SqliteStore};
use idempotent_tests::{PgServer, RedisCluster, RedisServer, unique};
use serde_json::Value;

const HOUR: Duration = Duration::from_secs(3600);

/// Runs the binary with `args` on the store at `url`.
async fn cli(url: &str, args: &[&str]) -> Output {
    cli_in(Path::new("."), url, args).await
}

/// Runs the binary with `args` on the store at `url`, in the directory `dir`.
async fn cli_in(dir: &Path, url: &str, args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotent"))
        .current_dir(dir)
        .arg("--store")
        .arg(url)
        .args(args)
        .output()
        .await
        .expect("run the idempotent binary")
}

fn code(out: &Output) -> i32 {
    out.status.code().expect("exited, not killed")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(out)))
}

/// A SQLite store in a temp dir, and its URL.
async fn sqlite() -> (tempfile::TempDir, SharedStore, String) {
    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join("records.db");
    let store: SharedStore = Arc::new(SqliteStore::connect(&path).await.unwrap());
    (dir, store, format!("sqlite://{}", path.display()))
}

/// Takes `step(payload)` of `run` as the executor would, and leaves it held for an hour (a
/// worker that died holding a long lease).
async fn held(store: &SharedStore, run: &str, step: &str, payload: u32) -> (Key, u64) {
    let (key, fingerprint) = RunContext::new(store.clone(), run).step(step).key_for(&payload).unwrap();
    let Acquire::Acquired(grant) =
        store.acquire_labeled(&key, &fingerprint, HOUR, HOUR, Labels::step(step).run(run)).await.unwrap()
    else {
        panic!("a fresh key")
    };
    (key, grant.attempt.fence())
}

/// Runs `step(payload)` of `run` to completion with the result `payload * 10`.
async fn done(store: &SharedStore, run: &str, step: &str, payload: u32) -> Key {
    let ctx = RunContext::new(store.clone(), run);
    let out: u32 = ctx.step(step).run(&payload, |_| async move { Ok::<_, Error>(payload * 10) }).await.unwrap();
    assert_eq!(out, payload * 10);
    ctx.step(step).key_for(&payload).unwrap().0
}

fn never<T>(what: &'static str) -> impl FnOnce(Attempt) -> std::future::Ready<Result<T, Error>> {
    move |_| panic!("the {what} must not be called")
}

/// A worker died holding a long lease: `release` refuses the wrong fence, prints a plan without
/// --yes, releases with it, and the next call is recovered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_lease_is_released_and_the_next_call_recovers() {
    let (_dir, store, url) = sqlite().await;
    let run = unique("rel");
    let (key, fence) = held(&store, &run, "charge", 1).await;
    let hex = key.to_hex();

    let inspected = cli(&url, &["--json", "inspect", &hex]).await;
    assert_eq!(code(&inspected), 0, "{}", stderr(&inspected));
    let record = json(&inspected);
    assert_eq!((record["state"].as_str(), record["fence"].as_u64()), (Some("running"), Some(fence)));
    assert_eq!((record["step"].as_str(), record["run"].as_str()), (Some("charge"), Some(run.as_str())));

    let wrong = cli(&url, &["release", &hex, "--fence", &(fence + 1).to_string(), "--yes"]).await;
    assert_eq!(code(&wrong), 4, "another fence is refused");
    assert!(stderr(&wrong).contains(&format!("held at fence {fence}")), "{}", stderr(&wrong));

    let dry = cli(&url, &["release", &hex, "--fence", &fence.to_string()]).await;
    assert_eq!(code(&dry), 5, "without --yes nothing changes");
    assert!(stdout(&dry).contains("Would release") && stdout(&dry).contains("--yes"), "{}", stdout(&dry));
    assert_eq!(store.inspect(&key).await.unwrap().unwrap().state, RecordState::Running);

    let released = cli(&url, &["release", &hex, "--fence", &fence.to_string(), "--yes"]).await;
    assert_eq!(code(&released), 0, "{}", stderr(&released));
    assert!(stdout(&released).contains("Released"), "{}", stdout(&released));
    assert_eq!(store.inspect(&key).await.unwrap().unwrap().state, RecordState::Stuck);

    let again = cli(&url, &["release", &hex, "--fence", &fence.to_string(), "--yes"]).await;
    assert_eq!(code(&again), 4, "nothing holds it any more: {}", stderr(&again));
    let reported = cli(&url, &["--json", "reconcile", "--run", &run]).await;
    assert_eq!(code(&reported), 0, "{}", stderr(&reported));
    assert_eq!(json(&reported)["stuck"][0]["key"].as_str(), Some(hex.as_str()), "reported as stuck");

    let ran: u32 = RunContext::new(store.clone(), &run)
        .step("charge")
        .on_in_flight(idempotent_core::OnInFlight::Reject)
        .run(&1u32, |attempt: Attempt| async move {
            assert!(attempt.recovered(), "the released attempt may have run");
            assert!(attempt.fence() > fence);
            Ok::<_, Error>(99)
        })
        .await
        .unwrap();
    assert_eq!(ran, 99);
}

/// Records found by what the executor and the HTTP layer derive their keys from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_finds_a_record_by_the_call_or_the_client_key() {
    let (_dir, store, url) = sqlite().await;
    let run = unique("ins");
    done(&store, &run, "charge", 7).await;
    let by_call = cli(&url, &["--json", "inspect", "--run", &run, "--step", "charge", "--args", "7"]).await;
    assert_eq!(code(&by_call), 0, "{}", stderr(&by_call));
    let record = json(&by_call);
    // The stored outcome: `a1:` (the attempt that made it), then `o70`.
    assert_eq!((record["state"].as_str(), record["result_bytes"].as_u64()), (Some("done"), Some(6)), "{record}");

    let other_args = cli(&url, &["inspect", "--run", &run, "--step", "charge", "--args", "8"]).await;
    assert_eq!(code(&other_args), 3, "no record for other arguments");
    assert!(stderr(&other_args).contains("no record"), "{}", stderr(&other_args));

    let key = Key::from_client_key(Some("acme"), "http", "k-1");
    let fp = idempotent_core::Fingerprint::from_bytes([1; 32]);
    let labels = Labels::step("http").tenant(Some("acme"));
    assert!(matches!(store.acquire_labeled(&key, &fp, HOUR, HOUR, labels).await.unwrap(), Acquire::Acquired(_)));
    let by_header = cli(&url, &["--json", "inspect", "--http-key", "k-1", "--tenant", "acme"]).await;
    assert_eq!(code(&by_header), 0, "{}", stderr(&by_header));
    assert_eq!(json(&by_header)["key"].as_str(), Some(key.to_hex().as_str()));

    let bad = cli(&url, &["inspect", "not-a-key"]).await;
    assert_eq!(code(&bad), 2);
    assert!(stderr(&bad).contains("64 hex digits"), "{}", stderr(&bad));
}

/// A record that needs attention is resolved as done: every later call replays the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolve_settles_a_record_that_needs_attention() {
    let (_dir, store, url) = sqlite().await;
    let run = unique("res");
    let (key, fingerprint) = RunContext::new(store.clone(), &run).step("refund").key_for(&1u32).unwrap();
    let Acquire::Acquired(grant) =
        store.acquire_labeled(&key, &fingerprint, HOUR, HOUR, Labels::step("refund").run(&run)).await.unwrap()
    else {
        panic!()
    };
    store.abandon(&key, &grant.token, Abandon::NeedsAttention).await.unwrap();
    let hex = key.to_hex();
    let listed = cli(&url, &["--json", "list", "--state", "needs_attention"]).await;
    assert_eq!(json(&listed)["records"][0]["key"].as_str(), Some(hex.as_str()));

    let dry = cli(&url, &["resolve", &hex, "--done", "\"re_42\""]).await;
    assert_eq!(code(&dry), 5);
    let bad = cli(&url, &["resolve", &hex, "--done", "re_42", "--yes"]).await;
    assert_eq!(code(&bad), 2, "not JSON");
    assert!(stderr(&bad).contains("not JSON"), "{}", stderr(&bad));
    let resolved = cli(&url, &["resolve", &hex, "--done", "\"re_42\"", "--yes"]).await;
    assert_eq!(code(&resolved), 0, "{}", stderr(&resolved));
    let replay: String = RunContext::new(store.clone(), &run).step("refund").run(&1u32, never("action")).await.unwrap();
    assert_eq!(replay, "re_42");
    let twice = cli(&url, &["resolve", &hex, "--not-done", "--yes"]).await;
    assert_eq!(code(&twice), 4, "a done record is not resolved again");
}

/// purge by run removes that run's records (not running ones) and leaves other runs intact;
/// stats counts by step and state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_by_run_leaves_other_runs_intact() {
    let (_dir, store, url) = sqlite().await;
    let (doomed, kept) = (unique("doomed"), unique("kept"));
    let mut doomed_keys = Vec::new();
    for i in 0..5 {
        doomed_keys.push(done(&store, &doomed, "charge", i).await);
    }
    let (running, _) = held(&store, &doomed, "email", 1).await;
    let kept_keys: Vec<Key> = seed_done(&store, &kept).await;

    let stats = cli(&url, &["--json", "stats", "--run", &doomed]).await;
    let stats = json(&stats);
    assert_eq!(stats["steps"]["charge"]["done"].as_u64(), Some(5), "{stats}");
    assert_eq!(stats["steps"]["email"]["running"].as_u64(), Some(1), "{stats}");
    assert_eq!(stats["total"].as_u64(), Some(6));

    let no_filter = cli(&url, &["purge", "--yes"]).await;
    assert_eq!(code(&no_filter), 2, "purge without a run, step or age is refused");
    let dry = cli(&url, &["purge", "--run", &doomed]).await;
    assert_eq!(code(&dry), 5);
    assert!(stdout(&dry).contains("Would remove 5 records"), "{}", stdout(&dry));
    assert!(store.inspect(&doomed_keys[0]).await.unwrap().is_some(), "the dry run removed nothing");

    let purged = cli(&url, &["--json", "purge", "--run", &doomed, "--yes"]).await;
    assert_eq!(code(&purged), 0, "{}", stderr(&purged));
    let report = json(&purged);
    assert_eq!((report["removed"].as_u64(), report["running"].as_u64()), (Some(5), Some(1)), "{report}");
    for key in &doomed_keys {
        assert_eq!(store.inspect(key).await.unwrap(), None);
    }
    assert!(store.inspect(&running).await.unwrap().is_some(), "a live lease is left alone");
    for key in &kept_keys {
        assert_eq!(store.inspect(key).await.unwrap().unwrap().state, RecordState::Done, "another run is intact");
    }
}

async fn seed_done(store: &SharedStore, run: &str) -> Vec<Key> {
    let mut keys = Vec::new();
    for i in 0..3 {
        keys.push(done(store, run, "charge", i).await);
    }
    keys
}

/// On a 3-master cluster, `list` finds the records on every master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_scan_finds_records_on_every_master() {
    let cluster = RedisCluster::start();
    let url = cluster.urls().join(",");
    let store = idempotent_core::store::connect(&url).await.unwrap();
    let run = unique("cluster");
    let mut keys = BTreeSet::new();
    for i in 0..30 {
        keys.insert(done(&store, &run, "charge", i).await.to_hex());
    }
    let per_node = cluster.keys_per_node();
    assert!(per_node.iter().all(|&k| k > 0), "a master holds no record: {per_node:?}");
    let listed = cli(&url, &["--json", "list", "--run", &run, "--limit", "1000"]).await;
    assert_eq!(code(&listed), 0, "{}", stderr(&listed));
    let found: BTreeSet<String> =
        json(&listed)["records"].as_array().unwrap().iter().map(|r| r["key"].as_str().unwrap().to_owned()).collect();
    assert_eq!(found, keys, "every record, from every master");
}

/// doctor passes on a SQLite file, and names the problem on a Redis that persists nothing;
/// every finding is a sentence (what was checked, what was found, what to do), never a Rust
/// value's debug form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_checks_the_store() {
    let (_dir, store, url) = sqlite().await;
    let ok = cli(&url, &["doctor"]).await;
    assert_eq!(code(&ok), 0, "{}{}", stdout(&ok), stderr(&ok));
    let text = stdout(&ok);
    for line in [
        format!("Checked {}:\n", store.describe()),
        "ok      write a record: took the lease on a probe record (step `idempotent-doctor`) in ".into(),
        "ok      read it back: the probe record is there, running, attempt 1\n".into(),
        "ok      delete it: released the probe's lease and deleted the record\n".into(),
        "ok      list records: the store lists its records".into(),
        "All 4 checks passed.\n".into(),
    ] {
        assert!(text.contains(&line), "missing {line:?} in:\n{text}");
    }
    assert!(!text.contains("Ok(") && !text.contains("Err(") && !text.contains("Some("), "{text}");
    assert!(store.scan(&Filter::all(), &Cursor::start(), 10).await.unwrap().records.is_empty(), "no probe left");

    // The harness's Redis runs without persistence (`--save ""`): a risk to the guarantee.
    let server = RedisServer::start();
    let risky = cli(&server.url(), &["--json", "doctor"]).await;
    assert_eq!(code(&risky), 4, "{}", stdout(&risky));
    let report = json(&risky);
    assert_eq!(report["ok"], false, "{report}");
    let check = |name: &str| report["checks"].as_array().unwrap().iter().find(|c| c["check"] == name).unwrap().clone();
    let persistence = check("Redis persistence");
    assert_eq!(persistence["ok"], false);
    assert!(persistence["found"].as_str().unwrap().contains("save"), "{persistence}");
    assert!(persistence["fix"].as_str().unwrap().contains("appendonly yes"), "{persistence}");
    assert_eq!(check("Redis eviction")["ok"], true, "the harness's Redis does not evict: {report}");
    let risky_text = stdout(&cli(&server.url(), &["doctor"]).await);
    assert!(risky_text.contains("FAILED  Redis persistence: persistence is off"), "{risky_text}");
    assert!(risky_text.contains("        to fix it: run `CONFIG SET appendonly yes`"), "{risky_text}");
    assert!(risky_text.contains("1 of 8 checks failed"), "{risky_text}");
    assert!(!risky_text.contains("Ok(") && !risky_text.contains("Err("), "{risky_text}");
    // What the deployment relies on: notes, not failures, until the application says what it needs.
    assert!(risky_text.contains("note    TLS: connections are not encrypted (redis://)"), "{risky_text}");
    assert!(risky_text.contains("note    Redis replicas: none connected"), "{risky_text}");
    let waits = stdout(&cli(&server.url(), &["doctor", "--wait-for-replicas", "1"]).await);
    assert!(
        waits.contains("FAILED  Redis replicas: 0 replicas connected, and a store with wait_for_replicas(1)"),
        "{waits}"
    );
    assert!(waits.contains("2 of 8 checks failed"), "{waits}");
    let _replica = RedisServer::replica_of(&server);
    server.wait_replicated();
    let waits = stdout(&cli(&server.url(), &["doctor", "--wait-for-replicas", "1"]).await);
    assert!(
        waits.contains("ok      Redis replicas: 1 replica connected, as many as wait_for_replicas(1) needs"),
        "{waits}"
    );

    let pg = PgServer::start();
    let on_postgres = cli(&pg.url(), &["doctor"]).await;
    assert_eq!(code(&on_postgres), 0, "{}{}", stdout(&on_postgres), stderr(&on_postgres));
    let pg_text = stdout(&on_postgres);
    assert!(pg_text.contains("ok      pooler: connected to PostgreSQL itself"), "{pg_text}");
    assert!(pg_text.contains("note    TLS: the connection is not encrypted"), "{pg_text}");

    let unreachable = cli("redis://127.0.0.1:1", &["doctor"]).await;
    assert_eq!(code(&unreachable), 1, "the store could not be reached: {}", stdout(&unreachable));
    let err = stderr(&unreachable);
    assert!(err.contains("doctor cannot reach") && err.contains("127.0.0.1:1"), "{err}");
    assert!(err.contains("server is running"), "{err}");
    assert!(!err.contains("fail-open"), "not the library's note for a step's call: {err}");
    let missing = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotent"))
        .arg("stats")
        .env_remove("IDEMPOTENT_STORE")
        .output()
        .await
        .unwrap();
    assert_eq!(code(&missing), 2);
    assert!(stderr(&missing).contains("--store"), "{}", stderr(&missing));
}

/// A SQLite path that does not exist is refused (it would otherwise be created, and a typo would
/// look like an empty store), and nothing is created; `?mode=rwc` creates it, as in sqlx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_sqlite_file_is_refused_and_nothing_is_created() {
    let dir = tempfile::TempDir::new().unwrap();
    let files = || std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect::<Vec<_>>();
    for args in [&["stats"][..], &["list"], &["doctor"], &["--json", "stats"]] {
        let out = cli_in(dir.path(), "sqlite://nonexistent.db", args).await;
        assert_eq!(code(&out), 1, "{args:?}: {}{}", stdout(&out), stderr(&out));
        let err = stderr(&out);
        assert!(err.contains("no SQLite database at `nonexistent.db`"), "{err}");
        assert!(err.contains("check the path") && err.contains("--store 'sqlite://nonexistent.db?mode=rwc'"), "{err}");
        assert!(files().is_empty(), "{args:?} created {:?}", files());
    }
    let absolute = format!("sqlite://{}", dir.path().join("missing.db").display());
    assert_eq!(code(&cli(&absolute, &["stats"]).await), 1);
    assert!(files().is_empty(), "created {:?}", files());

    let directory = cli(&format!("sqlite://{}", dir.path().display()), &["stats"]).await;
    assert_eq!(code(&directory), 1);
    assert!(stderr(&directory).contains("is a directory"), "{}", stderr(&directory));
    let unknown = cli_in(dir.path(), "sqlite://nonexistent.db?mode=ro", &["stats"]).await;
    assert_eq!(code(&unknown), 2, "{}", stderr(&unknown));
    assert!(stderr(&unknown).contains("`mode=ro`"), "{}", stderr(&unknown));
    assert!(files().is_empty(), "created {:?}", files());

    let created = cli_in(dir.path(), "sqlite://nonexistent.db?mode=rwc", &["--json", "stats"]).await;
    assert_eq!(code(&created), 0, "{}", stderr(&created));
    assert_eq!(json(&created)["total"].as_u64(), Some(0));
    assert!(dir.path().join("nonexistent.db").is_file(), "created: {:?}", files());
    let reopened = cli_in(dir.path(), "sqlite:nonexistent.db", &["--json", "stats"]).await;
    assert_eq!(code(&reopened), 0, "an existing file opens without ?mode=rwc: {}", stderr(&reopened));
}

/// The 12 hex digits `list` prints name the record in `inspect`, `release` and `resolve`, as
/// does any unambiguous start of the key, in either case, and the whole key; a start several
/// keys share is refused with their count, and one no key has is "no such record".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_as_list_prints_it_names_the_record() {
    let (_dir, store, url) = sqlite().await;
    let run = unique("prefix");
    let (key, fence) = held(&store, &run, "charge", 1).await;
    let hex = key.to_hex();

    let listed = cli(&url, &["list", "--run", &run]).await;
    assert_eq!(code(&listed), 0, "{}", stderr(&listed));
    let text = stdout(&listed);
    let printed = text.lines().nth(1).and_then(|row| row.split_whitespace().next()).unwrap().to_owned();
    assert_eq!(printed, hex[..12], "list prints the key's first 12 hex digits:\n{text}");

    for name in [printed.clone(), printed.to_uppercase(), hex[..6].to_owned(), hex.clone()] {
        let inspected = cli(&url, &["--json", "inspect", &name]).await;
        assert_eq!(code(&inspected), 0, "inspect {name}: {}", stderr(&inspected));
        assert_eq!(json(&inspected)["key"].as_str(), Some(hex.as_str()), "inspect {name}");
    }
    let dry = cli(&url, &["release", &printed, "--fence", &fence.to_string()]).await;
    assert_eq!(code(&dry), 5, "{}", stderr(&dry));
    assert!(stdout(&dry).contains(&format!("Would release record {printed}")), "{}", stdout(&dry));
    let released = cli(&url, &["release", &printed, "--fence", &fence.to_string(), "--yes"]).await;
    assert_eq!(code(&released), 0, "{}", stderr(&released));
    assert_eq!(store.inspect(&key).await.unwrap().unwrap().state, RecordState::Stuck);
    let not_attention = cli(&url, &["resolve", &printed, "--not-done", "--yes"]).await;
    assert_eq!(code(&not_attention), 4, "found, and refused as stuck: {}", stderr(&not_attention));

    // Two records whose keys start with the same 4 hex digits.
    let mut first_seen = std::collections::HashMap::new();
    let (a, b) = (0u32..)
        .map(|i| Key::from_client_key(None, "http", &format!("{run}-{i}")))
        .find_map(|k| first_seen.insert(k.to_hex()[..4].to_owned(), k).map(|other| (other, k)))
        .unwrap();
    let fp = idempotent_core::Fingerprint::from_bytes([2; 32]);
    for k in [a, b] {
        assert!(matches!(
            store.acquire_labeled(&k, &fp, HOUR, HOUR, Labels::step("http")).await.unwrap(),
            Acquire::Acquired(_)
        ));
    }
    let shared = &a.to_hex()[..4];
    let ambiguous = cli(&url, &["inspect", shared]).await;
    assert_eq!(code(&ambiguous), 2, "{}", stderr(&ambiguous));
    let err = stderr(&ambiguous);
    assert!(err.contains(&format!("{shared} is the start of 2 records' keys")), "{err}");
    assert!(err.contains(&a.to_hex()) && err.contains(&b.to_hex()) && err.contains("give more of the key"), "{err}");
    let longer = cli(&url, &["--json", "inspect", &a.to_hex()[..20]]).await;
    assert_eq!(json(&longer)["key"].as_str(), Some(a.to_hex().as_str()), "more digits tell them apart");

    let absent = (0u32..)
        .map(|i| format!("{i:012x}"))
        .find(|p| ![key, a, b].iter().any(|k| k.to_hex().starts_with(p.as_str())))
        .unwrap();
    let missing = cli(&url, &["inspect", &absent]).await;
    assert_eq!(code(&missing), 3, "{}", stderr(&missing));
    assert!(stderr(&missing).contains(&format!("no record's key starts with {absent}")), "{}", stderr(&missing));
    let short = cli(&url, &["inspect", &hex[..3]]).await;
    assert_eq!(code(&short), 2, "too short to be a key's start");
    assert!(stderr(&short).contains("at least 4"), "{}", stderr(&short));
}

/// Counts of records read "1 record", "2 records" everywhere the CLI counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_of_one_record_are_singular() {
    let (_dir, store, url) = sqlite().await;
    let run = unique("one");
    done(&store, &run, "charge", 1).await;
    let (_, _) = held(&store, &run, "email", 1).await;

    let dry = cli(&url, &["purge", "--run", &run]).await;
    assert_eq!(code(&dry), 5);
    assert!(
        stdout(&dry).starts_with("Would remove 1 record (1 done, 1 running); 1 running record left alone."),
        "{}",
        stdout(&dry)
    );
    let purged = cli(&url, &["purge", "--run", &run, "--yes"]).await;
    assert_eq!(code(&purged), 0, "{}", stderr(&purged));
    assert_eq!(stdout(&purged), "Removed 1 record; 1 running record left alone.\n");

    let two = unique("two");
    done(&store, &two, "charge", 1).await;
    done(&store, &two, "charge", 2).await;
    let purged = cli(&url, &["purge", "--run", &two, "--yes"]).await;
    assert_eq!(stdout(&purged), "Removed 2 records; 0 running records left alone.\n");

    let stuck = unique("stuck");
    let (key, fingerprint) = RunContext::new(store.clone(), &stuck).step("charge").key_for(&1u32).unwrap();
    let Acquire::Acquired(grant) =
        store.acquire_labeled(&key, &fingerprint, HOUR, HOUR, Labels::step("charge").run(&stuck)).await.unwrap()
    else {
        panic!("a fresh key")
    };
    store.abandon(&key, &grant.token, Abandon::Uncertain).await.unwrap();
    let reported = cli(&url, &["reconcile", "--run", &stuck]).await;
    assert_eq!(code(&reported), 0, "{}", stderr(&reported));
    assert!(stdout(&reported).contains("\n1 stuck record. Run a Reconciler"), "{}", stdout(&reported));
    let none = cli(&url, &["reconcile", "--run", &run]).await;
    assert!(stdout(&none).contains("0 stuck records."), "{}", stdout(&none));
}

/// A PostgreSQL store in a schema of its own, over TLS: the URL's `?schema=` and
/// `sslmode`/`sslrootcert` reach the same records the service wrote; without `?schema=` the
/// command looks in another table and does not find them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_store_in_a_schema_over_tls_is_reached_by_its_url() {
    let pg = PgServer::start_tls();
    let tls = format!("sslmode=verify-full&sslrootcert={}", pg.tls().ca.display());
    let url = format!("postgres://postgres@localhost:{}/postgres?{tls}&schema=payments", pg.port());
    let store: SharedStore = Arc::new(idempotent_core::PostgresStore::connect(&url).await.unwrap());
    let run = unique("schema");
    let (key, fence) = held(&store, &run, "charge", 1).await;
    let hex = key.to_hex();

    let inspected = cli(&url, &["--json", "inspect", &hex]).await;
    assert_eq!(code(&inspected), 0, "{}", stderr(&inspected));
    assert_eq!(json(&inspected)["fence"].as_u64(), Some(fence));
    let elsewhere = format!("postgres://postgres@localhost:{}/postgres?{tls}", pg.port());
    assert_eq!(code(&cli(&elsewhere, &["inspect", &hex]).await), 3, "the record is in the schema only");
}
