//! One target with what its rows share ([`Env`]), and the calls of each row.

use super::*;

/// One target with what its rows share.
pub(crate) struct Env<T: Target> {
    pub(crate) target: T,
    pub(crate) store: SharedStore,
    pub(crate) ctx: RunContext,
    /// The payload the rows borrow (with a sequence number of their own).
    pub(crate) payload: Refund,
    pub(crate) seq: AtomicU64,
    /// The keys of the replay payloads, for the diagnostic rows that call the store directly.
    pub(crate) replay_keys: Vec<(Key, Fingerprint)>,
    pub(crate) floor_keys: Vec<[u8; 32]>,
    pub(crate) peer_keys: Vec<String>,
    /// The stored result, as the executor stores it.
    pub(crate) stored: Vec<u8>,
}

pub(crate) fn random_key() -> [u8; 32] {
    let mut k = [0; 32];
    k[..16].copy_from_slice(&fastrand::u128(..).to_le_bytes());
    k[16..].copy_from_slice(&fastrand::u128(..).to_le_bytes());
    k
}

pub(crate) fn replay_index(task: usize, i: u64) -> u64 {
    (task as u64 * 7919 + i) % REPLAY_KEYS
}

impl<T: Target> Env<T> {
    /// The environment, with the replay rows' records made done through each side (when `replay`).
    pub(crate) async fn new(target: T, replay: bool) -> Env<T> {
        let store = target.store();
        let mut stored = vec![b'o'];
        serde_json::to_writer(&mut stored, &RefundResult::sample()).unwrap();
        let n = if replay { REPLAY_KEYS } else { 0 };
        let env = Env {
            ctx: RunContext::new(store.clone(), "bench-run"),
            store,
            payload: Refund::new(0),
            seq: AtomicU64::new(1 << 40),
            replay_keys: Vec::new(),
            floor_keys: (0..n).map(|_| random_key()).collect(),
            peer_keys: (0..n).map(|_| format!("{:032x}", fastrand::u128(..))).collect(),
            stored,
            target,
        };
        let replay_keys = (0..n).map(|i| env.ctx.step("replayed_refund").key_for(&Refund::new(i)).unwrap()).collect();
        let env = Env { replay_keys, ..env };
        for i in 0..n {
            let r: RefundResult = env
                .ctx
                .step("replayed_refund")
                // The borrowed view: the same key as `Refund::new(i)` (the diagnostic replay row,
                // keyed by those, asserts that it finds these records).
                .run(&env.payload.with_seq(i), |_| async { Ok::<_, Error>(RefundResult::sample()) })
                .await
                .unwrap();
            black_box(r);
            env.target.floor_first(&env.floor_keys[i as usize], &env.stored).await;
            if let Some(peer) = env.target.peer() {
                let out = peer
                    .effect("replayed_refund", &env.peer_keys[i as usize])
                    .remote_idempotency(true)
                    .input(&env.payload.with_seq(i))
                    .run(|_| async { Ok::<_, EffectFailure>(RefundResult::sample()) })
                    .await
                    .expect("peer first execution");
                assert!(matches!(out, EffectOutcome::Committed(_)), "peer: {out:?}");
            }
        }
        env
    }

    pub(crate) async fn call(&self, path: Path, task: usize, i: u64) {
        match path {
            Path::OursFirst => {
                let payload = self.payload.with_seq(self.seq.fetch_add(1, Ordering::Relaxed));
                let r: RefundResult = self
                    .ctx
                    .step("issue_refund")
                    .run(&payload, |_| async { Ok::<_, Error>(RefundResult::sample()) })
                    .await
                    .expect("first execution");
                black_box(r);
            }
            Path::StoreFirst => {
                let key = Key::from_bytes(random_key());
                let fp = Fingerprint::from_bytes([7; 32]);
                let Acquire::Acquired(lease) =
                    self.store.acquire(&key, &fp, DEFAULT_LEASE, DEFAULT_RETENTION).await.expect("acquire")
                else {
                    panic!("a fresh key was not acquired")
                };
                let stored = Bytes::copy_from_slice(&self.stored);
                let t = self.store.complete(&key, &lease.token, stored, DEFAULT_RETENTION).await.expect("complete");
                assert_eq!(t, Transition::Ok);
            }
            Path::FloorFirst => self.target.floor_first(&random_key(), &self.stored).await,
            Path::FloorFirstGated => {
                let key = random_key();
                self.target
                    .floor_first_gated(&key, &self.stored)
                    .expect("gated rows run only where there is a gate")
                    .await
            }
            Path::PeerFirst => {
                let peer = self.target.peer().expect("peer rows run only with a peer");
                let payload = self.payload.with_seq(self.seq.fetch_add(1, Ordering::Relaxed));
                let out = peer
                    .effect("issue_refund", format!("{:032x}", fastrand::u128(..)))
                    .remote_idempotency(true)
                    .input(&payload)
                    .run(|_| async { Ok::<_, EffectFailure>(RefundResult::sample()) })
                    .await
                    .expect("peer first execution");
                assert!(matches!(out, EffectOutcome::Committed(_)), "peer: {out:?}");
            }
            Path::OursReplay => {
                let payload = self.payload.with_seq(replay_index(task, i));
                let r: RefundResult = self
                    .ctx
                    .step("replayed_refund")
                    .run(&payload, |_| async { Err::<RefundResult, _>(Error::Config("replay ran".into())) })
                    .await
                    .expect("replay");
                black_box(r);
            }
            Path::StoreReplay => {
                let (key, fp) = &self.replay_keys[replay_index(task, i) as usize];
                let a = self.store.acquire(key, fp, DEFAULT_LEASE, DEFAULT_RETENTION).await.expect("acquire");
                assert!(matches!(a, Acquire::Replay(_)));
            }
            Path::ReadFirstReplay => {
                let (key, fp) = &self.replay_keys[replay_index(task, i) as usize];
                self.target.read_first_replay(key, fp).expect("the read-first row runs only where written").await
            }
            Path::FloorReplay => self.target.floor_replay(&self.floor_keys[replay_index(task, i) as usize]).await,
            Path::FloorUpsert => self.target.floor_upsert(&self.floor_keys[replay_index(task, i) as usize]).await,
            Path::PeerReplay => {
                let peer = self.target.peer().expect("peer rows run only with a peer");
                let n = replay_index(task, i);
                let out = peer
                    .effect("replayed_refund", &self.peer_keys[n as usize])
                    .remote_idempotency(true)
                    .input(&self.payload.with_seq(n))
                    .run(|_| async { Err::<RefundResult, _>(EffectFailure::permanent("replay ran")) })
                    .await
                    .expect("peer replay");
                assert!(matches!(out, EffectOutcome::Committed(_)), "peer replay: {out:?}");
            }
        }
    }
}

pub(crate) async fn run<T: Target>(env: &Arc<Env<T>>, path: Path, concurrency: usize, duration: Duration) -> Sample {
    let env = env.clone();
    closed_loop(concurrency, duration, move |task, i| {
        let env = env.clone();
        async move { env.call(path, task, i).await }
    })
    .await
}
