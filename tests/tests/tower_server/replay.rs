//! Replays: byte for byte over HTTP/1.1, with trailers over HTTP/2, and as the replay hook changes
//! them; which outcomes are stored and replayed and which release the key; and a corrupt record,
//! which is never replayed.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use idempotent_core::SharedStore;
use idempotent_tests::HookedStore;

use crate::app::{App, raw_post, without_headers};

idempotent_tests::on_every_store!(
    replay_is_byte_identical_over_http1,
    replay_keeps_trailers_over_http2,
    retryable_outcomes_release_the_key_and_final_ones_are_replayed,
    a_corrupt_record_is_500_and_never_replayed,
    the_replay_hook_changes_replayed_responses_only,
);

async fn replay_is_byte_identical_over_http1(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let request = raw_post("/refunds", "\"raw-1\"", r#"{"order":"o-1","amount":1500}"#);
    let first = app.raw(&request).await;
    let second = app.raw(&request).await;
    assert_eq!(app.effects.calls(), 1);

    let first_text = String::from_utf8_lossy(&first);
    assert!(first_text.starts_with("HTTP/1.1 201 Created\r\n"), "{first_text}");
    assert_eq!(first_text.matches("set-cookie: ").count(), 2, "{first_text}");
    assert!(!first_text.contains("idempotent-replayed"));
    // The handler ran under a lease and saw its fence.
    let fence = first_text.split("\r\nx-fence: ").nth(1).and_then(|rest| rest.split("\r\n").next());
    assert!(fence.is_some_and(|f| f.parse::<u64>().is_ok_and(|f| f > 0)), "{first_text}");
    let second_text = String::from_utf8_lossy(&second);
    assert!(second_text.contains("\r\nidempotent-replayed: true\r\n"), "{second_text}");

    // Apart from the date and the replay marker, the replay is the first response, byte for byte.
    assert_eq!(
        String::from_utf8_lossy(&without_headers(&second, &["date", "idempotent-replayed"])),
        String::from_utf8_lossy(&without_headers(&first, &["date"])),
    );

    // The bare form of the same key names the same record.
    let bare = app.raw(&raw_post("/refunds", "raw-1", r#"{"order":"o-1","amount":1500}"#)).await;
    assert_eq!(without_headers(&bare, &["date", "idempotent-replayed"]), without_headers(&first, &["date"]));
    assert_eq!(app.effects.calls(), 1);
}

async fn replay_keeps_trailers_over_http2(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let first = app.h2(app.post("/trailers", "t-1"), "{}").await;
    let second = app.h2(app.post("/trailers", "t-1"), "{}").await;
    assert_eq!(app.effects.calls(), 1);
    assert_eq!(first.status, StatusCode::OK);
    assert!(!first.replayed());
    assert!(second.replayed());
    assert_eq!(first.body, Bytes::from_static(b"streamed 1 \x00\xffbinary"));
    assert_eq!(second.body, first.body);
    let trailers = second.trailers.as_ref().expect("replayed trailers");
    assert_eq!(trailers, first.trailers.as_ref().unwrap());
    assert_eq!(trailers["x-checksum"], "sum-1");
    assert_eq!(trailers.get_all("x-multi").iter().collect::<Vec<_>>(), ["one", "two"]);
}

async fn the_replay_hook_changes_replayed_responses_only(store: SharedStore) {
    let hooked = Arc::new(AtomicUsize::new(0));
    let counted = hooked.clone();
    let app = App::start(&store, move |l| {
        l.on_replay(move |parts: &mut http::response::Parts| {
            counted.fetch_add(1, Ordering::SeqCst);
            assert_eq!(parts.headers["idempotent-replayed"], "true", "the hook sees the marked replay");
            parts.headers.insert("x-replay-note", HeaderValue::from_static("from the hook"));
            // A stored header the hook replaces, and one it removes.
            parts.headers.insert("content-type", HeaderValue::from_static("application/vnd.replay+json"));
            parts.headers.remove("x-refund");
        })
    })
    .await;
    let body = r#"{"order":"o-1","amount":100}"#;
    let first = app.h1(app.post("/refunds", "hook-1"), body).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.headers.contains_key("x-replay-note"), "the first response is not a replay");
    assert!(first.headers.contains_key("x-refund"), "{:?}", first.headers);
    let refused = app.h1(app.post("/refunds", "hook-1"), r#"{"order":"o-1","amount":200}"#).await;
    refused.problem(422, "key-reused");
    assert!(!refused.headers.contains_key("x-replay-note"), "a refusal is not a replay");
    assert_eq!(hooked.load(Ordering::SeqCst), 0);

    for n in 1..=2 {
        let reply = match n {
            1 => app.h1(app.post("/refunds", "hook-1"), body).await,
            _ => app.h2(app.post("/refunds", "hook-1"), body).await,
        };
        assert!(reply.replayed());
        assert_eq!(reply.headers["x-replay-note"], "from the hook");
        assert_eq!(reply.headers["content-type"], "application/vnd.replay+json");
        assert!(!reply.headers.contains_key("x-refund"));
        assert_eq!((reply.status, &reply.body), (first.status, &first.body), "status and body are the stored ones");
        assert_eq!(hooked.load(Ordering::SeqCst), n);
    }
    assert_eq!(app.effects.calls(), 1);
}

async fn retryable_outcomes_release_the_key_and_final_ones_are_replayed(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    for code in [500u16, 502, 503, 408, 409, 425, 429] {
        let key = format!("release-{code}");
        let first = app.h1(app.post(&format!("/status/{code}"), &key), "{}").await;
        let before = app.effects.calls();
        let second = app.h2(app.post(&format!("/status/{code}"), &key), "{}").await;
        assert_eq!((first.status.as_u16(), second.status.as_u16()), (code, code));
        assert!(!second.replayed(), "{code} was stored");
        assert_eq!(app.effects.calls(), before + 1, "{code}: the retry did not run the handler");
    }
    for code in [200u16, 202, 400, 404, 422] {
        let key = format!("store-{code}");
        let first = app.h1(app.post(&format!("/status/{code}"), &key), "{}").await;
        let before = app.effects.calls();
        let second = app.h2(app.post(&format!("/status/{code}"), &key), "{}").await;
        assert_eq!(second.status.as_u16(), code);
        assert!(second.replayed(), "{code} was not stored");
        assert_eq!(second.body, first.body);
        assert_eq!(app.effects.calls(), before);
    }
}

/// A store that writes garbage in place of every result: the record a buggy or foreign writer
/// would leave behind. Everything else goes to the real store.
fn corrupting(store: SharedStore) -> SharedStore {
    let corrupting =
        HookedStore::new(store).describe_as(|inner| format!("corrupting {inner}")).on_complete(|mut call| {
            call.result = Bytes::from_static(b"IDRS\x01\x00\xc8\xff\xff\xff\xffnot a response");
            call.forward()
        });
    Arc::new(corrupting)
}

async fn a_corrupt_record_is_500_and_never_replayed(store: SharedStore) {
    let corrupting = corrupting(store);
    let app = App::start(&corrupting, |l| l).await;
    assert_eq!(app.h1(app.post("/refunds", "c-1"), "{}").await.status, StatusCode::CREATED);
    for _ in 0..2 {
        let reply = app.h2(app.post("/refunds", "c-1"), "{}").await;
        reply.problem(500, "record-corrupt");
        assert!(!reply.replayed());
    }
    assert_eq!(app.effects.calls(), 1, "a corrupt record must not run the handler again");
}
