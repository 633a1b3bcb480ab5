//! The conformance suite's half for reading and administering records: labels, `inspect`,
//! `scan`, `release_fenced` and `delete` (see `idempotent_core::store::admin`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use idempotent_core::record::{Abandon, Acquire, Grant, Labels, Resolution, Resolved, Transition};
use idempotent_core::store::{Cursor, Deleted, Filter, RecordInfo, RecordState, delete_all};
use idempotent_core::{Key, SharedStore};

use super::{KEEP, LEASE, fp, fresh_key};

/// Runs every admin check against `store`.
pub async fn run_admin(store: &SharedStore) {
    labels_and_times_are_read_back(store).await;
    every_state_reads_as_what_it_is(store).await;
    inspect_of_an_absent_key_is_none(store).await;
    scan_pages_through_a_run_with_a_cursor(store).await;
    scan_filters_by_state_step_tenant_and_idleness(store).await;
    release_fenced_takes_the_key_only_at_that_fence(store).await;
    delete_refuses_a_live_lease_and_keeps_fences_growing(store).await;
    a_foreign_cursor_is_a_clear_error(store).await;
    delete_all_removes_a_runs_records_but_live_leases(store).await;
}

async fn take(store: &SharedStore, key: &Key, labels: Labels<'_>, lease: Duration) -> Grant {
    match store.acquire_labeled(key, &fp(1), lease, KEEP, labels).await.expect("acquire") {
        Acquire::Acquired(grant) => grant,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

async fn info(store: &SharedStore, key: &Key) -> RecordInfo {
    store.inspect(key).await.expect("inspect").expect("the record exists")
}

/// Within a few seconds of `now` (store clocks and ours are both wall clocks here).
fn near(t: SystemTime, now: SystemTime) -> bool {
    let gap = t.duration_since(now).unwrap_or_else(|e| e.duration());
    gap < Duration::from_secs(5)
}

/// An acquisition's labels, attempt and fence are read back, and so are its times; completing
/// keeps the labels, attempt and fence and records the result's size.
async fn labels_and_times_are_read_back(store: &SharedStore) {
    let key = fresh_key();
    let run = crate::unique("admin-run");
    let grant = take(store, &key, Labels::step("charge").run(&run).tenant(Some("acme")), LEASE).await;
    let now = SystemTime::now();
    let running = info(store, &key).await;
    assert_eq!(running.key, key);
    assert_eq!(running.fingerprint, fp(1));
    assert_eq!(running.state, RecordState::Running);
    assert_eq!(
        (running.step.as_str(), running.run.as_deref(), running.tenant.as_deref()),
        ("charge", Some(run.as_str()), Some("acme"))
    );
    assert_eq!((running.attempt, running.fence), (1, grant.attempt.fence()));
    assert!(near(running.created, now) && near(running.updated, now), "{running:?}");
    let lease_until = running.lease_until.expect("a running record has a lease");
    assert!(lease_until > now && near(lease_until, now + LEASE), "lease until {lease_until:?}");
    let expires = running.expires.expect("a running record expires");
    assert!(expires >= lease_until, "a running record is kept at least for its lease");
    assert_eq!(running.result_bytes, None);

    store.complete(&key, &grant.token, Bytes::from_static(b"twelve bytes"), KEEP).await.unwrap();
    let done = info(store, &key).await;
    assert_eq!(done.state, RecordState::Done);
    assert_eq!(
        (done.step.as_str(), done.run.as_deref(), done.tenant.as_deref()),
        ("charge", Some(run.as_str()), Some("acme"))
    );
    assert_eq!((done.attempt, done.fence), (1, grant.attempt.fence()), "a done record keeps its attempt and fence");
    assert_eq!(done.result_bytes, Some(12));
    assert_eq!(done.lease_until, None);
    assert!(done.updated >= done.created);
    // Kept for the retention from the completion (exactly: `retention.rs`).
    assert!(done.expires.is_some_and(|e| near(e, now + KEEP)), "kept for the retention: {done:?}");

    // No labels: an empty step, no run, no tenant.
    let bare = fresh_key();
    let grant = match store.acquire(&bare, &fp(1), LEASE, KEEP).await.unwrap() {
        Acquire::Acquired(g) => g,
        other => panic!("{other:?}"),
    };
    let read = info(store, &bare).await;
    assert_eq!((read.step.as_str(), read.run, read.tenant), ("", None, None));
    store.release(&bare, &grant.token).await.unwrap();
}

/// Running, stuck (lease passed, or abandoned uncertain), released, needs attention and done
/// read as such; a record that needs attention does not expire.
async fn every_state_reads_as_what_it_is(store: &SharedStore) {
    let labels = Labels::step("states");
    let released = fresh_key();
    let g = take(store, &released, labels, LEASE).await;
    store.release(&released, &g.token).await.unwrap();
    assert_eq!(info(store, &released).await.state, RecordState::Released);

    let uncertain = fresh_key();
    let g = take(store, &uncertain, labels, LEASE).await;
    store.abandon(&uncertain, &g.token, Abandon::Uncertain).await.unwrap();
    let read = info(store, &uncertain).await;
    assert_eq!((read.state, read.fence), (RecordState::Stuck, g.attempt.fence()), "abandoned uncertain");

    let attention = fresh_key();
    let g = take(store, &attention, labels, LEASE).await;
    store.abandon(&attention, &g.token, Abandon::NeedsAttention).await.unwrap();
    let read = info(store, &attention).await;
    assert_eq!((read.state, read.expires, read.attempt), (RecordState::NeedsAttention, None, 1));
    assert_eq!(read.step, "states", "labels survive the mark");
    store.resolve(&attention, Resolution::NotDone).await.unwrap();
    assert_eq!(info(store, &attention).await.state, RecordState::Released);

    let expired = fresh_key();
    let short = Duration::from_millis(150);
    take(store, &expired, labels, short).await;
    assert_eq!(info(store, &expired).await.state, RecordState::Running);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let read = info(store, &expired).await;
    assert_eq!(read.state, RecordState::Stuck, "the lease ran out with no outcome: {read:?}");
    assert!(read.lease_until.is_some_and(|t| t <= SystemTime::now()));
    // The next acquisition is recovered, and reads as running again (attempt 2).
    let g = take(store, &expired, labels, LEASE).await;
    assert!(g.attempt.recovered());
    let read = info(store, &expired).await;
    assert_eq!((read.state, read.attempt, read.fence), (RecordState::Running, 2, g.attempt.fence()));
}

async fn inspect_of_an_absent_key_is_none(store: &SharedStore) {
    assert_eq!(store.inspect(&fresh_key()).await.unwrap(), None);
}

/// Scans the whole store for `filter`, `limit` at a time, and answers each listed record by key
/// (a store may list a record twice; the pages never list one that fails the filter).
async fn scan_all(store: &SharedStore, filter: &Filter, limit: usize) -> BTreeMap<Key, RecordInfo> {
    let mut found = BTreeMap::new();
    let mut cursor = Cursor::start();
    for pages in 0.. {
        assert!(pages < 100_000, "the scan does not end");
        let page = store.scan(filter, &cursor, limit).await.expect("scan");
        assert!(page.records.len() <= limit, "a page holds at most the limit");
        for record in page.records {
            assert!(
                filter.matches(&record, SystemTime::now()) || filter.idle_for.is_some(),
                "{record:?} fails {filter:?}"
            );
            found.insert(record.key, record);
        }
        match page.next {
            Some(next) => cursor = next,
            None => break,
        }
    }
    found
}

/// Every record of a run is listed, across pages of 3, and nothing else.
async fn scan_pages_through_a_run_with_a_cursor(store: &SharedStore) {
    let run = crate::unique("scan-run");
    let other_run = crate::unique("scan-other");
    let mut keys = BTreeSet::new();
    for i in 0..10 {
        let key = fresh_key();
        let step = if i % 2 == 0 { "even" } else { "odd" };
        let g = take(store, &key, Labels::step(step).run(&run), LEASE).await;
        if i % 3 == 0 {
            store.complete(&key, &g.token, Bytes::from_static(b"x"), KEEP).await.unwrap();
        }
        keys.insert(key);
    }
    take(store, &fresh_key(), Labels::step("even").run(&other_run), LEASE).await;
    let found = scan_all(store, &Filter::all().run(&run), 3).await;
    assert_eq!(found.keys().copied().collect::<BTreeSet<_>>(), keys, "exactly the run's records");
    let evens = scan_all(store, &Filter::all().run(&run).step("even"), 2).await;
    assert_eq!(evens.len(), 5);
    assert!(evens.values().all(|r| r.step == "even"));
    let done = scan_all(store, &Filter::all().run(&run).state(RecordState::Done), 1000).await;
    assert_eq!(done.len(), 4, "records 0, 3, 6 and 9 are done");
}

/// State, tenant and idleness filters.
async fn scan_filters_by_state_step_tenant_and_idleness(store: &SharedStore) {
    let run = crate::unique("filter-run");
    let labels = |tenant| Labels::step("f").run(&run).tenant(tenant);
    let a = fresh_key();
    let g = take(store, &a, labels(Some("t1")), LEASE).await;
    store.abandon(&a, &g.token, Abandon::Uncertain).await.unwrap();
    let b = fresh_key();
    let g = take(store, &b, labels(Some("t2")), LEASE).await;
    store.abandon(&b, &g.token, Abandon::NeedsAttention).await.unwrap();
    let c = fresh_key();
    take(store, &c, labels(None), LEASE).await;

    let run = run.as_str();
    let by =
        |filter: Filter| async move { scan_all(store, &filter.run(run), 50).await.into_keys().collect::<Vec<_>>() };
    assert_eq!(by(Filter::all().state(RecordState::Stuck)).await, vec![a]);
    assert_eq!(by(Filter::all().state(RecordState::NeedsAttention)).await, vec![b]);
    assert_eq!(by(Filter::all().state(RecordState::Running)).await, vec![c]);
    assert_eq!(by(Filter::all().tenant("t2")).await, vec![b]);
    assert!(by(Filter::all().idle_for(Duration::from_secs(3600))).await.is_empty(), "nothing is an hour old");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(by(Filter::all().idle_for(Duration::from_millis(200))).await.len(), 3);
}

/// release_fenced takes a live lease only at the holder's fence: the holder loses it, the record
/// reads as stuck, and the next attempt is recovered with a higher fence.
async fn release_fenced_takes_the_key_only_at_that_fence(store: &SharedStore) {
    let key = fresh_key();
    let holder = take(store, &key, Labels::step("fenced"), LEASE).await;
    let fence = holder.attempt.fence();
    assert_eq!(store.release_fenced(&key, fence + 1).await.unwrap(), Resolved::Unchanged, "another fence");
    assert_eq!(info(store, &key).await.state, RecordState::Running);
    assert_eq!(store.release_fenced(&key, fence).await.unwrap(), Resolved::Ok);
    assert_eq!(store.release_fenced(&key, fence).await.unwrap(), Resolved::Unchanged, "released already");
    assert_eq!(info(store, &key).await.state, RecordState::Stuck);
    assert_eq!(store.renew(&key, &holder.token, LEASE).await.unwrap(), Transition::LeaseLost);
    assert_eq!(
        store.complete(&key, &holder.token, Bytes::from_static(b"late"), KEEP).await.unwrap(),
        Transition::LeaseLost,
        "the old holder can no longer complete"
    );
    let next = take(store, &key, Labels::step("fenced"), LEASE).await;
    assert!(next.attempt.recovered() && next.attempt.fence() > fence && next.attempt.number() == 2);
    store.complete(&key, &next.token, Bytes::from_static(b"ok"), KEEP).await.unwrap();
    assert_eq!(
        store.release_fenced(&key, next.attempt.fence()).await.unwrap(),
        Resolved::Unchanged,
        "a done record is left alone"
    );
    assert_eq!(store.acquire(&key, &fp(1), LEASE, KEEP).await.unwrap(), Acquire::Replay(Bytes::from_static(b"ok")));
    assert_eq!(store.release_fenced(&fresh_key(), 1).await.unwrap(), Resolved::Unchanged, "absent");
}

/// delete refuses a live lease, removes anything else, and the next attempt starts at 1 with a
/// higher fence.
async fn delete_refuses_a_live_lease_and_keeps_fences_growing(store: &SharedStore) {
    let key = fresh_key();
    let g = take(store, &key, Labels::step("del"), LEASE).await;
    assert_eq!(store.delete(&key).await.unwrap(), Deleted::Running);
    assert!(store.inspect(&key).await.unwrap().is_some());
    store.complete(&key, &g.token, Bytes::from_static(b"r"), KEEP).await.unwrap();
    assert_eq!(store.delete(&key).await.unwrap(), Deleted::Ok);
    assert_eq!(store.inspect(&key).await.unwrap(), None);
    assert_eq!(store.delete(&key).await.unwrap(), Deleted::Absent);
    let again = take(store, &key, Labels::step("del"), LEASE).await;
    assert_eq!((again.attempt.number(), again.attempt.recovered()), (1, false));
    assert!(again.attempt.fence() > g.attempt.fence(), "fences grow past a deleted record");

    let attention = fresh_key();
    let g = take(store, &attention, Labels::step("del"), LEASE).await;
    store.abandon(&attention, &g.token, Abandon::NeedsAttention).await.unwrap();
    assert_eq!(
        store.delete(&attention).await.unwrap(),
        Deleted::Ok,
        "an operator may drop a record that needs attention"
    );
}

/// A cursor another store (or a person) made up is refused with an error, not a panic or an
/// endless scan.
async fn a_foreign_cursor_is_a_clear_error(store: &SharedStore) {
    let err = store.scan(&Filter::all(), &Cursor::from_text("not a cursor"), 10).await.unwrap_err();
    assert!(err.to_string().contains("cursor"), "{err}");
}

/// delete_all by run removes that run's records, leaves a live lease of it, and every record of
/// another run.
async fn delete_all_removes_a_runs_records_but_live_leases(store: &SharedStore) {
    let (run, other) = (crate::unique("purge-run"), crate::unique("purge-other"));
    let mut doomed = Vec::new();
    for _ in 0..5 {
        let key = fresh_key();
        let g = take(store, &key, Labels::step("p").run(&run), LEASE).await;
        store.complete(&key, &g.token, Bytes::from_static(b"r"), KEEP).await.unwrap();
        doomed.push(key);
    }
    let live = fresh_key();
    take(store, &live, Labels::step("p").run(&run), LEASE).await;
    let kept = fresh_key();
    take(store, &kept, Labels::step("p").run(&other), LEASE).await;
    let purged = delete_all(store.as_ref(), &Filter::all().run(&run)).await.unwrap();
    assert_eq!((purged.removed, purged.running), (5, 1), "{purged:?}");
    for key in &doomed {
        assert_eq!(store.inspect(key).await.unwrap(), None);
    }
    assert!(store.inspect(&live).await.unwrap().is_some(), "a live lease is left alone");
    assert!(store.inspect(&kept).await.unwrap().is_some(), "another run is untouched");
}
