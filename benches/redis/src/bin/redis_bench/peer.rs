//! The peer: the `idempotent` crate 0.3.0's `ValkeyStore`, driven as its documentation shows.

use bytes::Bytes;
use idempotent_benches::{RefundResult, RefundView};
use idempotent_core::DEFAULT_RETENTION;
use idempotent_peer::entry::ExistingEntry;
use idempotent_peer::fingerprint::{DefaultFingerprintStrategy, FingerprintStrategy};
use idempotent_peer::store::valkey::ValkeyStore;
use idempotent_peer::store::{IdempotencyStore, InsertResult};
use idempotent_peer::{CachedResponse, IdempotencyEntry, IdempotencyKey, Metadata};

/// The peer, `idempotent` 0.3.0's `ValkeyStore`, driven as its documentation shows: claim the
/// key, run the action, complete with the response; or decode the stored response.
pub(crate) struct Peer {
    pub(crate) store: ValkeyStore,
}

impl Peer {
    /// A call of `step` with `payload`: its body is the payload's JSON (and its fingerprint the
    /// crate's default strategy over it), its key the run, the step and the payload's sequence
    /// number (the crate takes keys from the caller; ours derives them from the payload).
    pub(crate) async fn run(
        &self,
        step: &str,
        payload: &RefundView<'_>,
        action: impl FnOnce() -> RefundResult,
    ) -> RefundResult {
        let body = serde_json::to_vec(payload).expect("payload JSON");
        let fp = DefaultFingerprintStrategy.compute(step, &body);
        let key = IdempotencyKey::new(format!("bench-run:{step}:{}", payload.seq)).expect("peer key");
        // 0.3.0 has one TTL for the claim and the stored response: the retention.
        let entry = IdempotencyEntry::new(fp, DEFAULT_RETENTION);
        match self.store.try_insert(&key, entry.clone()).await.expect("peer claim") {
            InsertResult::Claimed { fencing_token } => {
                let result = action();
                let body = Bytes::from(serde_json::to_vec(&result).expect("result JSON"));
                let response = CachedResponse { status_code: 200, metadata: Metadata::default(), body };
                self.store.complete(&key, entry.complete(response), fencing_token).await.expect("peer complete");
                result
            }
            InsertResult::Exists(ExistingEntry::Completed(done)) => {
                assert!(done.fingerprint_matches(fp), "peer: another payload under the key");
                serde_json::from_slice(&done.response().body).expect("peer: stored result")
            }
            InsertResult::Exists(ExistingEntry::Processing(_)) => panic!("peer: the key is in flight"),
        }
    }
}
