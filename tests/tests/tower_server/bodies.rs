//! Request and response bodies: requests over the cap (413, with or without `Content-Length`) or
//! failing mid-stream (400), responses over the store's cap (sent, not stored) or failing
//! mid-stream (the key released).

use bytes::Bytes;
use http::StatusCode;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use idempotent_core::SharedStore;

use crate::app::{App, BoxError, Reply, full};

idempotent_tests::on_every_store!(
    bodies_over_the_cap_are_413_with_or_without_content_length,
    a_body_that_fails_mid_stream_is_400,
    responses_over_the_store_cap_are_sent_but_not_stored,
    a_response_body_that_fails_releases_the_key,
);

async fn bodies_over_the_cap_are_413_with_or_without_content_length(store: SharedStore) {
    let app = App::start(&store, |l| l.max_request_body(1024)).await;
    // Announced by Content-Length.
    app.h1(app.post("/refunds", "big-1"), vec![b'x'; 2048]).await.problem(413, "body-too-large");
    // Chunked, with no Content-Length: caught while reading.
    let chunked = || {
        let chunks: Vec<Result<Frame<Bytes>, BoxError>> =
            (0..3).map(|_| Ok(Frame::data(Bytes::from(vec![b'y'; 600])))).collect();
        StreamBody::new(futures_util::stream::iter(chunks)).boxed()
    };
    let req = app.post("/refunds", "big-2").body(chunked()).unwrap();
    assert!(req.headers().get("content-length").is_none());
    Reply::read(app.h1.request(req).await.unwrap()).await.problem(413, "body-too-large");
    let req = app.post("/refunds", "big-3").body(chunked()).unwrap();
    Reply::read(app.h2.request(req).await.unwrap()).await.problem(413, "body-too-large");
    assert_eq!(app.effects.calls(), 0);

    // Exactly at the cap is fine, and the handler sees the whole body.
    let ok = app.h1(app.post("/refunds", "big-4"), vec![b'z'; 1024]).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert!(ok.text().contains("\"bytes\":1024"), "{}", ok.text());
    // A refused key was never taken: the same key works once the body is small enough.
    assert_eq!(app.h1(app.post("/refunds", "big-1"), "{}").await.status, StatusCode::CREATED);
    assert_eq!(app.effects.calls(), 2);
}

async fn a_body_that_fails_mid_stream_is_400(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    // A chunked body whose second chunk size is not hex: hyper's body stream fails there.
    let request = b"POST /refunds HTTP/1.1\r\nHost: test\r\nIdempotency-Key: broken-1\r\n\
                    Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\nzz\r\n";
    let raw = app.raw(request).await;
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{text}");
    assert!(text.contains("tag:idempotent-tower,2025:body-unreadable"), "{text}");
    assert_eq!(app.effects.calls(), 0);
    // The key was never taken.
    assert_eq!(app.h1(app.post("/refunds", "broken-1"), "{}").await.status, StatusCode::CREATED);
}

async fn responses_over_the_store_cap_are_sent_but_not_stored(store: SharedStore) {
    let app = App::start(&store, |l| l.max_stored_response(1024)).await;
    let first = app.h1(app.post("/big?bytes=4096", "big-response"), "{}").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body.len(), 4096, "the client gets the whole response");
    assert!(first.body.starts_with(b"call 1;") && first.body[7..].iter().all(|&b| b == b'x'));
    let second = app.h2(app.post("/big?bytes=4096", "big-response"), "{}").await;
    assert!(!second.replayed());
    assert!(second.body.starts_with(b"call 2;"));
    assert_eq!(second.body.len(), 4096);
    // At the cap it is stored.
    let small = app.h1(app.post("/big?bytes=1024", "small-response"), "{}").await;
    let replay = app.h1(app.post("/big?bytes=1024", "small-response"), "{}").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, small.body);
    assert_eq!(app.effects.calls(), 3);
}

async fn a_response_body_that_fails_releases_the_key(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    for n in 1..=2 {
        let req = app.post("/failing", "fails").body(full("{}")).unwrap();
        // The stream is reset, before or after the head depending on timing: never a clean reply.
        match app.h2.request(req).await {
            Err(e) => assert!(format!("{e:?}").contains("Reset"), "{e:?}"),
            Ok(res) => {
                assert!(res.headers().get("idempotent-replayed").is_none());
                assert!(res.into_body().collect().await.is_err(), "the body error reaches the client");
            }
        }
        assert_eq!(app.effects.calls(), n, "a failed response must not be stored");
    }
}
