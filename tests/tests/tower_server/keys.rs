//! The idempotency key: one record per tenant, another request under the same key (422), a
//! missing key (passed through, or 400 when required), malformed keys (400), the methods covered and
//! the header's name, and the downstream key the handler sees for each idempotency key.

use axum::Router;
use axum::routing::post;
use http::{HeaderName, HeaderValue, Method, StatusCode};
use idempotent_core::SharedStore;
use idempotent_tower::server::IdempotencyLayer;

use crate::app::{App, Effects, Reply, refund};

idempotent_tests::on_every_store!(
    tenants_never_share_a_record,
    another_request_under_the_same_key_is_422,
    missing_key_passes_through_or_is_400_when_required,
    malformed_keys_are_400,
    methods_and_header_name_are_configurable,
    the_handler_sees_one_downstream_key_per_idempotency_key,
);

async fn tenants_never_share_a_record(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let body = r#"{"order":"o-1","amount":1500}"#;
    let a1 = app.h1(app.post("/refunds", "shared").header("x-tenant", "acme"), body).await;
    let b1 = app.h1(app.post("/refunds", "shared").header("x-tenant", "globex"), body).await;
    assert_eq!((a1.status, b1.status), (StatusCode::CREATED, StatusCode::CREATED));
    assert!(!b1.replayed(), "tenant globex got tenant acme's response");
    assert_eq!(a1.headers["x-refund"], "re_1");
    assert_eq!(b1.headers["x-refund"], "re_2");

    let a2 = app.h2(app.post("/refunds", "shared").header("x-tenant", "acme"), body).await;
    let b2 = app.h2(app.post("/refunds", "shared").header("x-tenant", "globex"), body).await;
    assert!(a2.replayed() && b2.replayed());
    assert_eq!(a2.body, a1.body);
    assert_eq!(b2.body, b1.body);

    // Another tenant's payload under the same key is not a mismatch: it is another record.
    let c = app.h1(app.post("/refunds", "shared").header("x-tenant", "initech"), r#"{"other":true}"#).await;
    assert_eq!(c.status, StatusCode::CREATED);
    // Nor is a request without a tenant.
    let anonymous = app.h1(app.post("/refunds", "shared"), body).await;
    assert_eq!(anonymous.status, StatusCode::CREATED);
    assert!(!anonymous.replayed());
    assert_eq!(app.effects.calls(), 4);
}

async fn another_request_under_the_same_key_is_422(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let first = app.h1(app.post("/refunds", "m-1"), r#"{"order":"o-1","amount":100}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);

    // Key order and whitespace are not a different request.
    let same = app.h1(app.post("/refunds", "m-1"), "{ \"amount\" : 100,\n  \"order\": \"o-1\" }").await;
    assert!(same.replayed());
    assert_eq!(same.body, first.body);

    let other_body = app.h1(app.post("/refunds", "m-1"), r#"{"order":"o-1","amount":200}"#).await;
    other_body.problem(422, "key-reused");
    let other_query = app.h2(app.post("/refunds?dry_run=1", "m-1"), r#"{"order":"o-1","amount":100}"#).await;
    other_query.problem(422, "key-reused");
    let other_method =
        app.h1(app.req("PATCH", "/refunds").header("idempotency-key", "m-1"), r#"{"order":"o-1","amount":100}"#).await;
    other_method.problem(422, "key-reused");
    let other_path = app.h1(app.post("/status/201", "m-1"), r#"{"order":"o-1","amount":100}"#).await;
    other_path.problem(422, "key-reused");
    assert_eq!(app.effects.calls(), 1);
}

async fn missing_key_passes_through_or_is_400_when_required(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    for _ in 0..2 {
        let reply = app.h1(app.req("POST", "/refunds"), "{}").await;
        assert_eq!(reply.status, StatusCode::CREATED);
        // The handler can tell: no attempt, and why it runs unprotected.
        assert_eq!(
            (&reply.headers["x-fence"], &reply.headers["x-unprotected"]),
            (&"none".parse().unwrap(), &"NoKey".parse().unwrap())
        );
    }
    assert_eq!(app.effects.calls(), 2, "without a key, requests pass through unprotected");
    // A method the layer does not cover carries nothing of the layer's.
    let get = app.h1(app.req("GET", "/refunds"), "").await;
    assert!(get.headers.get("x-unprotected").is_none(), "{:?}", get.headers);

    let strict = App::start(&store, |l| l.require_key(true)).await;
    strict.h1(strict.req("POST", "/refunds"), "{}").await.problem(400, "key-missing");
    strict.h2(strict.req("PATCH", "/refunds"), "{}").await.problem(400, "key-missing");
    // Methods the layer does not cover never need a key.
    assert_eq!(strict.h1(strict.req("GET", "/refunds"), "").await.status, StatusCode::CREATED);
    assert_eq!(strict.effects.calls(), 1);

    // Required on one route only, by layering that route.
    let effects = Effects::new();
    let router = Router::new()
        .route("/strict", post(refund).layer(IdempotencyLayer::new(store.clone()).require_key(true)))
        .route("/lenient", post(refund))
        .with_state(effects.clone())
        .layer(IdempotencyLayer::new(store.clone()));
    let routed = App::serve(router, effects).await;
    routed.h1(routed.req("POST", "/strict"), "{}").await.problem(400, "key-missing");
    assert_eq!(routed.h1(routed.req("POST", "/lenient"), "{}").await.status, StatusCode::CREATED);
    assert_eq!(routed.effects.calls(), 1);
    // With a key, the outer layer handles the request and the route's layer stands aside.
    assert_eq!(routed.h1(routed.post("/strict", "nested"), "{}").await.status, StatusCode::CREATED);
    assert!(routed.h1(routed.post("/strict", "nested"), "{}").await.replayed());
    assert_eq!(routed.effects.calls(), 2);
}

async fn malformed_keys_are_400(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let long = "k".repeat(256);
    let quoted_long = format!("\"{long}\"");
    // Empty, empty string, 256 characters (both forms), non-ASCII, malformed, a list, whitespace
    // only, and a control character (tab: the one a header value may carry).
    let cases: [&[u8]; 10] = [
        b"",
        b"\"\"",
        long.as_bytes(),
        quoted_long.as_bytes(),
        b"caf\xc3\xa9",
        b"\"unterminated",
        b"\"a\", \"b\"",
        b"   ",
        b"a\tb",
        b"\"a\tb\"",
    ];
    for key in cases {
        let req = app.req("POST", "/refunds").header("idempotency-key", HeaderValue::from_bytes(key).unwrap());
        let doc = app.h1(req, "{}").await.problem(400, "key-invalid");
        assert!(doc["detail"].as_str().unwrap().contains("idempotency-key"), "{doc}");
    }
    let twice = app.req("POST", "/refunds").header("idempotency-key", "one").header("idempotency-key", "one");
    let doc = app.h1(twice, "{}").await.problem(400, "key-invalid");
    assert!(doc["detail"].as_str().unwrap().contains("more than once"), "{doc}");
    let twice_h2 = app.req("POST", "/refunds").header("idempotency-key", "a").header("idempotency-key", "b");
    app.h2(twice_h2, "{}").await.problem(400, "key-invalid");
    assert_eq!(app.effects.calls(), 0);

    // The longest key allowed works, in both forms.
    let longest = "k".repeat(255);
    assert_eq!(app.h1(app.post("/refunds", &longest), "{}").await.status, StatusCode::CREATED);
    assert!(app.h1(app.post("/refunds", &format!("\"{longest}\"")), "{}").await.replayed());
    assert_eq!(app.effects.calls(), 1);
}

async fn methods_and_header_name_are_configurable(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    // GET is not covered by default: the key is ignored.
    for _ in 0..2 {
        let r = app.h1(app.req("GET", "/refunds").header("idempotency-key", "get-1"), "").await;
        assert!(!r.replayed());
    }
    // PATCH is.
    app.h1(app.req("PATCH", "/refunds").header("idempotency-key", "patch-1"), "{}").await;
    assert!(app.h1(app.req("PATCH", "/refunds").header("idempotency-key", "patch-1"), "{}").await.replayed());
    assert_eq!(app.effects.calls(), 3);

    let put_only = App::start(&store, |l| l.methods([Method::PUT]).scope("put-only")).await;
    for _ in 0..2 {
        assert!(!put_only.h1(put_only.post("/refunds", "m-1"), "{}").await.replayed());
    }
    put_only.h1(put_only.req("PUT", "/refunds").header("idempotency-key", "m-1"), "{}").await;
    assert!(put_only.h1(put_only.req("PUT", "/refunds").header("idempotency-key", "m-1"), "{}").await.replayed());
    assert_eq!(put_only.effects.calls(), 3);

    let custom = App::start(&store, |l| {
        l.header_name(HeaderName::from_static("x-request-key")).scope("custom").require_key(true)
    })
    .await;
    custom.h1(custom.post("/refunds", "c-1"), "{}").await.problem(400, "key-missing");
    let first = custom.h1(custom.req("POST", "/refunds").header("x-request-key", "c-1"), "{}").await;
    let second = custom.h1(custom.req("POST", "/refunds").header("x-request-key", "c-1"), "{}").await;
    assert!(!first.replayed() && second.replayed());
    assert_eq!(custom.effects.calls(), 1);
}

async fn the_handler_sees_one_downstream_key_per_idempotency_key(store: SharedStore) {
    let app = App::start(&store, |l| l).await;
    let downstream = |reply: &Reply| reply.headers["x-downstream-key"].to_str().unwrap().to_owned();
    let first = app.h1(app.post("/refunds", "dk-1"), "{}").await;
    let other = app.h1(app.post("/refunds", "dk-2"), "{}").await;
    let (a, b) = (downstream(&first), downstream(&other));
    assert_eq!(a.len(), 64);
    assert_ne!(a, b, "another Idempotency-Key, another downstream key");
    assert!(!a.contains("dk-1"), "the client's key does not show through");
    // The same key from another tenant is another operation.
    let tenant = app.h1(app.post("/refunds", "dk-1").header("x-tenant", "acme"), "{}").await;
    assert_ne!(downstream(&tenant), a);
    // A released attempt and the next one share it: a 503 from the handler frees the key, and
    // the retry runs the handler again under the same downstream key.
    let one = app.h1(app.post("/status/503", "dk-3"), "{}").await;
    let two = app.h2(app.post("/status/503", "dk-3"), "{}").await;
    assert_eq!((one.status, two.status), (StatusCode::SERVICE_UNAVAILABLE, StatusCode::SERVICE_UNAVAILABLE));
    assert!(!two.replayed(), "the handler ran again");
    assert_eq!(downstream(&one), downstream(&two));
    assert_ne!(downstream(&one), a);
}
