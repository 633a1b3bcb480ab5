//! The state store conformance suite ([`idempotent_core::state`]), run on every store: versions
//! and stale commits, retried commits recognised by their token, failing reducers, racing
//! creation, exact counts under contention, and parallel branches appending findings.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use idempotent_core::state::{
    Commit, CommitToken, Loaded, RawState, Scope, SharedStateStore, State, UpdatePolicy, Version,
};
use idempotent_core::{Backoff, Error};
use tokio::sync::Barrier;

/// A scope no other test uses.
pub fn fresh_scope(name: &str) -> Scope {
    Scope::new(crate::unique(name)).tenant("conformance")
}

/// A policy generous enough for 64-way contention on a slow machine: 2 ms base, 50 ms cap,
/// 10 000 rounds, an hour (600 s was once reached by an update through the lossy proxy on a
/// machine running three builds beside the tests: it then gave up, as it should).
pub fn patient() -> UpdatePolicy {
    UpdatePolicy::new(
        Backoff::new(Duration::from_millis(2), Duration::from_millis(50)).max_attempts(10_000),
        Duration::from_secs(3600),
    )
}

/// Every check below, on `store`.
pub async fn run_all(store: SharedStateStore) {
    versions_and_stale_commits(&store).await;
    a_retried_commit_is_recognised(&store).await;
    a_failing_reducer_leaves_the_state_unchanged(&store).await;
    contention_ends_in_a_clear_error(&store).await;
    racing_creation_creates_once(&store, 64).await;
    the_history_bound_holds(&store).await;
    an_unanswered_update_says_it_may_have_run(&store).await;
    // 32 writers of 25 updates each: every commit but the first contended.
    assert_eq!(counter(&store, 32, 25).await, 800);
}

/// Absent is version 0; a commit on it creates version 1; a commit on a version that is not
/// current is refused with the current value, and changes nothing.
pub async fn versions_and_stale_commits(store: &SharedStateStore) {
    let raw = RawState::new(store.clone(), fresh_scope("versions"));
    assert_eq!(raw.load().await.unwrap(), Loaded { value: None, version: Version::ABSENT });
    let first = raw.commit_with_token(Version::ABSENT, Bytes::from_static(b"a"), &CommitToken::random()).await;
    assert_eq!(first.unwrap(), Commit::Committed { version: Version::new(1), replayed: false });
    // A second creation, by another writer, is stale.
    let again = raw.commit_with_token(Version::ABSENT, Bytes::from_static(b"b"), &CommitToken::random()).await;
    assert_eq!(
        again.unwrap(),
        Commit::Conflict { current: Loaded { value: Some(Bytes::from_static(b"a")), version: Version::new(1) } }
    );
    let second = raw.commit_with_token(Version::new(1), Bytes::from_static(b"c"), &CommitToken::random()).await;
    assert_eq!(second.unwrap(), Commit::Committed { version: Version::new(2), replayed: false });
    for stale in [Version::new(1), Version::new(3)] {
        let refused = raw.commit_with_token(stale, Bytes::from_static(b"d"), &CommitToken::random()).await.unwrap();
        assert!(refused.is_conflict(), "a commit on version {stale} of a state at 2 went in: {refused:?}");
    }
    assert_eq!(raw.load().await.unwrap(), Loaded { value: Some(Bytes::from_static(b"c")), version: Version::new(2) });
    // The typed handle reads and writes canonical JSON.
    let typed: State<BTreeMap<String, u32>> = State::new(store.clone(), fresh_scope("typed"));
    let committed = typed.commit(Version::ABSENT, &BTreeMap::from([("b".into(), 2), ("a".into(), 1)])).await;
    assert!(!committed.unwrap().is_conflict());
    let raw = RawState::new(store.clone(), typed.scope().clone());
    assert_eq!(raw.load().await.unwrap().value.unwrap(), Bytes::from_static(br#"{"a":1,"b":2}"#));
}

/// A commit retried with its token after its reply was lost answers committed with the version
/// it produced (also when it now looks stale), and changes nothing; an update retried under the
/// same token applies its delta once.
pub async fn a_retried_commit_is_recognised(store: &SharedStateStore) {
    let counter: State<u64> = State::new(store.clone(), fresh_scope("retried"));
    let token = CommitToken::random();
    let first = counter.commit_with_token(Version::ABSENT, &1, &token).await.unwrap();
    assert_eq!(first, Commit::Committed { version: Version::new(1), replayed: false });
    // The reply was "lost": the same commit again.
    let retried = counter.commit_with_token(Version::ABSENT, &1, &token).await.unwrap();
    assert_eq!(retried, Commit::Committed { version: Version::new(1), replayed: true });
    // Others commit meanwhile; the retry still recognises itself, never a conflict with itself.
    counter.update(|n| Ok::<_, Error>(n.unwrap_or(0) + 10)).await.unwrap();
    let late = counter.commit_with_token(Version::ABSENT, &1, &token).await.unwrap();
    assert_eq!(late, Commit::Committed { version: Version::new(1), replayed: true });
    assert_eq!(counter.load().await.unwrap(), Loaded { value: Some(11), version: Version::new(2) });

    // An update whose commit landed but whose caller retries it under the same token: it finds
    // its own write, and does not add again.
    let token = CommitToken::random();
    let once = counter.update_with_token(&token, |n| Ok::<_, Error>(n.unwrap_or(0) + 1)).await.unwrap();
    assert_eq!((once.value, once.version, once.replayed), (12, Version::new(3), false));
    let twice = counter.update_with_token(&token, |n| Ok::<_, Error>(n.unwrap_or(0) + 1)).await.unwrap();
    assert_eq!((twice.value, twice.version, twice.replayed), (12, Version::new(3), true));
    assert_eq!(counter.load().await.unwrap().value, Some(12));
}

/// A reducer that fails ends the update with `Error::Reducer`, and the state is as it was.
pub async fn a_failing_reducer_leaves_the_state_unchanged(store: &SharedStateStore) {
    let cart: State<Vec<String>> = State::new(store.clone(), fresh_scope("reducer"));
    cart.modify(|items| items.push("tea".into())).await.unwrap();
    let before = cart.load().await.unwrap();
    let failed = cart.update(|_| Err::<Vec<String>, _>("out of stock")).await.unwrap_err();
    assert!(matches!(failed, Error::Reducer { .. }), "{failed:?}");
    let message = failed.to_string();
    assert!(message.contains("out of stock") && message.contains("nothing was committed"), "{message}");
    assert_eq!(cart.load().await.unwrap(), before);
}

/// An update that conflicts on every round ends in `Error::Contention` naming its attempts.
pub async fn contention_ends_in_a_clear_error(store: &SharedStateStore) {
    let scope = fresh_scope("contention");
    let policy =
        UpdatePolicy::new(Backoff::new(Duration::from_millis(1), Duration::from_millis(2)), Duration::from_secs(30))
            .attempts(3);
    let victim: State<u64> = State::new(store.clone(), scope.clone()).policy(policy);
    let rival: State<u64> = State::new(store.clone(), scope);
    rival.modify(|n| *n += 1).await.unwrap();
    let handle = tokio::runtime::Handle::current();
    let mut rounds = 0;
    // Each time the victim reduces, the rival commits first.
    let err = victim
        .update(|n| {
            rounds += 1;
            tokio::task::block_in_place(|| handle.block_on(rival.modify(|n| *n += 100))).unwrap();
            Ok::<_, Error>(n.unwrap_or(0) + 1)
        })
        .await
        .unwrap_err();
    assert_eq!(rounds, 3);
    assert!(matches!(err, Error::Contention { attempts: 3, .. }), "{err:?}");
    assert!(err.to_string().contains("after 3 attempts"), "{err}");
    assert!(err.is_transient());
    assert_eq!(rival.load().await.unwrap().value, Some(301), "the victim committed nothing");
}

/// `tasks` tasks create one absent state at once, each with its own value: exactly one commit
/// goes in, every other is a conflict showing the winner's value.
pub async fn racing_creation_creates_once(store: &SharedStateStore, tasks: usize) {
    let scope = fresh_scope("create");
    let barrier = Arc::new(Barrier::new(tasks));
    let answers = join_all((0..tasks).map(|t| {
        let (raw, barrier) = (RawState::new(store.clone(), scope.clone()), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            let value = Bytes::from(t.to_string());
            (t, raw.commit_with_token(Version::ABSENT, value, &CommitToken::random()).await.unwrap())
        })
    }))
    .await;
    let answers: Vec<_> = answers.into_iter().map(Result::unwrap).collect();
    let winners: Vec<usize> = answers
        .iter()
        .filter(|(_, a)| matches!(a, Commit::Committed { version, replayed: false } if *version == Version::new(1)))
        .map(|(t, _)| *t)
        .collect();
    assert_eq!(winners.len(), 1, "absent state created {} times", winners.len());
    let winner = Bytes::from(winners[0].to_string());
    for (t, answer) in &answers {
        if *t != winners[0] {
            let expected =
                Commit::Conflict { current: Loaded { value: Some(winner.clone()), version: Version::new(1) } };
            assert_eq!(answer, &expected, "task {t}");
        }
    }
}

/// A state store whose commits land and whose replies are lost while `lose` is on: the
/// store's answer never reaches the caller, as when a connection drops after the commit.
struct LosingReplies {
    inner: SharedStateStore,
    lose: std::sync::atomic::AtomicBool,
}

impl idempotent_core::StateStore for LosingReplies {
    fn load<'a>(&'a self, scope: &'a Scope) -> idempotent_core::store::BoxFuture<'a, Result<Loaded<Bytes>, Error>> {
        self.inner.load(scope)
    }

    fn commit<'a>(
        &'a self,
        scope: &'a Scope,
        expected: Version,
        value: Bytes,
        token: &'a CommitToken,
    ) -> idempotent_core::store::BoxFuture<'a, Result<Commit<Bytes>, Error>> {
        Box::pin(async move {
            let answer = self.inner.commit(scope, expected, value, token).await;
            if self.lose.load(std::sync::atomic::Ordering::SeqCst) {
                let reason = format!("the reply was lost (the commit answered {answer:?})");
                return Err(Error::Unavailable { store: "lossy".into(), op: "commit", reason, source: None });
            }
            answer
        })
    }

    fn describe(&self) -> String {
        format!("lossy {}", self.inner.describe())
    }
}

/// An update that gives up after commits whose replies were lost says that it may have been
/// applied, with the token to retry under; retried under it, it applies once. Outside a step the
/// error is not transient (a retry through `update` would draw a new token); inside one it is,
/// and the step's retry replays the update.
pub async fn an_unanswered_update_says_it_may_have_run(store: &SharedStateStore) {
    use std::sync::atomic::Ordering::SeqCst;
    let lossy = Arc::new(LosingReplies { inner: store.clone(), lose: true.into() });
    let scope = fresh_scope("unanswered");
    let quick = UpdatePolicy::default().attempts(3);
    let counter: State<u64> = State::new(lossy.clone() as SharedStateStore, scope.clone()).policy(quick);
    let plain: State<u64> = State::new(store.clone(), scope);
    let add = |n: Option<u64>| Ok::<_, Error>(n.unwrap_or(0) + 1);

    let error = counter.update(add).await.expect_err("every reply was lost");
    assert!(matches!(error, Error::CommitUnanswered { retry_derives_token: false, .. }), "{error:?}");
    assert!(error.action_may_have_run(), "{error}");
    assert!(!error.is_transient(), "a retry through update draws a new token: {error}");
    assert!(error.to_string().contains("update_with_token"), "{error}");
    assert_eq!(plain.load().await.unwrap().value, Some(1), "the commit landed once");
    lossy.lose.store(false, SeqCst);
    let token = error.commit_token().expect("the error carries its token");
    let retried = counter.update_with_token(&token, add).await.unwrap();
    assert_eq!((retried.value, retried.replayed), (1, true));
    assert_eq!(plain.load().await.unwrap().value, Some(1), "the retry under the token applied it again");

    // Inside a step the token is the step's: retrying the step is the safe retry.
    let ctx = idempotent_core::RunContext::new(idempotent_core::MemoryStore::new(), crate::unique("unanswered"));
    let step = || {
        ctx.step("add").run(&(), |_| async {
            counter.update(add).await?;
            Ok::<_, Error>(())
        })
    };
    lossy.lose.store(true, SeqCst);
    let error = step().await.expect_err("every reply was lost");
    assert!(matches!(error, Error::CommitUnanswered { retry_derives_token: true, .. }), "{error:?}");
    assert!(error.is_transient() && error.action_may_have_run(), "{error}");
    assert_eq!(plain.load().await.unwrap().value, Some(2));
    lossy.lose.store(false, SeqCst);
    step().await.unwrap();
    assert_eq!(plain.load().await.unwrap().value, Some(2), "the step's retry applied its update again");
}

/// A token is recognised while fewer than the store's `commit_history()` commits landed after it, and
/// forgotten after that (then its retry is an ordinary stale commit).
pub async fn the_history_bound_holds(store: &SharedStateStore) {
    let history = store.commit_history();
    let raw = RawState::new(store.clone(), fresh_scope("history"));
    let first = CommitToken::random();
    raw.commit_with_token(Version::ABSENT, Bytes::from_static(b"0"), &first).await.unwrap();
    for v in 1..history {
        let c = raw.commit_with_token(Version::new(v), Bytes::from(v.to_string()), &CommitToken::random()).await;
        assert!(!c.unwrap().is_conflict());
    }
    // Version `history` now; the first token is the oldest kept.
    let kept = raw.commit_with_token(Version::ABSENT, Bytes::from_static(b"0"), &first).await.unwrap();
    assert_eq!(kept, Commit::Committed { version: Version::new(1), replayed: true });
    let c = raw.commit_with_token(Version::new(history), Bytes::from_static(b"x"), &CommitToken::random()).await;
    assert!(!c.unwrap().is_conflict());
    let forgotten = raw.commit_with_token(Version::ABSENT, Bytes::from_static(b"0"), &first).await.unwrap();
    assert!(forgotten.is_conflict(), "a token older than the history was still recognised: {forgotten:?}");
}

/// `tasks` tasks each add 1 to one counter `updates` times (through `update`); answers the
/// final count, which must be `tasks × updates` exactly.
pub async fn counter(store: &SharedStateStore, tasks: usize, updates: usize) -> u64 {
    let scope = fresh_scope("counter");
    let barrier = Arc::new(Barrier::new(tasks));
    let results = join_all((0..tasks).map(|_| {
        let state: State<u64> = State::new(store.clone(), scope.clone()).policy(patient());
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            for _ in 0..updates {
                state.update(|n| Ok::<_, Error>(n.unwrap_or(0) + 1)).await.unwrap();
            }
        })
    }))
    .await;
    for r in results {
        r.unwrap();
    }
    let state: State<u64> = State::new(store.clone(), scope);
    // Through a proxy that loses replies, a load may fail too: read until one answers.
    let mut failures = 0;
    let loaded = loop {
        match state.load().await {
            Ok(loaded) => break loaded,
            Err(e) if e.is_transient() && failures < 100 => failures += 1,
            Err(e) => panic!("the final load failed: {e}"),
        }
    };
    assert_eq!(loaded.version.get(), loaded.value.unwrap_or(0), "one version per update");
    loaded.value.unwrap_or(0)
}
