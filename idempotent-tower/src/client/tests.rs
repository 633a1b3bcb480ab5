//! The key layer alone and in both orders around tower's `Retry`, over scripted services.

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use idempotent_core::{Key, KeyScope};
use tower::retry::{Policy, RetryLayer};
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};

use super::*;
use crate::IDEMPOTENCY_KEY;
use crate::retry::{Backoff, HttpRetryPolicy};

/// Records the key header of every request; answers 503 `failures` times, then 201, per call
/// count (an API whose replies keep getting lost to the client).
#[derive(Clone, Default)]
struct Api {
    keys: Arc<Mutex<Vec<Option<HeaderValue>>>>,
}

impl Api {
    fn service(
        &self,
        failures: usize,
    ) -> impl Service<
        Request<Full<Bytes>>,
        Response = Response<()>,
        Error = Infallible,
        Future = std::future::Ready<Result<Response<()>, Infallible>>,
    > + Clone {
        let keys = self.keys.clone();
        service_fn(move |request: Request<Full<Bytes>>| {
            let mut keys = keys.lock().unwrap();
            keys.push(request.headers().get(IDEMPOTENCY_KEY).cloned());
            let status = if keys.len() <= failures { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED };
            std::future::ready(Ok(Response::builder().status(status).body(()).unwrap()))
        })
    }

    fn keys(&self) -> Vec<Option<HeaderValue>> {
        self.keys.lock().unwrap().clone()
    }
}

fn post() -> Request<Full<Bytes>> {
    Request::post("http://api.test/refunds").body(Full::from("{\"order\":7}")).unwrap()
}

fn policy() -> HttpRetryPolicy {
    HttpRetryPolicy::new().backoff(Backoff::new(Duration::from_millis(10), Duration::from_millis(100)).max_attempts(5))
}

#[tokio::test]
async fn stamps_a_quoted_uuid_on_post_and_patch_only() {
    let api = Api::default();
    let service = IdempotencyKeyLayer::new().layer(api.service(0));
    for method in [Method::POST, Method::PATCH, Method::GET, Method::PUT, Method::DELETE] {
        let request = Request::builder().method(method).uri("http://api.test/x").body(Full::default()).unwrap();
        service.clone().oneshot(request).await.unwrap();
    }
    let keys = api.keys();
    for key in &keys[..2] {
        let key = key.as_ref().expect("POST and PATCH get a key").to_str().unwrap();
        let uuid = key.strip_prefix('"').and_then(|k| k.strip_suffix('"')).expect("an sf-string");
        assert_eq!(uuid::Uuid::parse_str(uuid).unwrap().get_version_num(), 4);
    }
    assert_ne!(keys[0], keys[1], "two logical requests, two keys");
    assert_eq!(&keys[2..], [None, None, None], "other methods are untouched by default");
}

#[tokio::test]
async fn keeps_a_key_the_caller_set() {
    let api = Api::default();
    let mut request = post();
    request.headers_mut().insert(IDEMPOTENCY_KEY, HeaderValue::from_static("order-7-refund"));
    IdempotencyKey::new(api.service(0)).oneshot(request).await.unwrap();
    assert_eq!(api.keys(), [Some(HeaderValue::from_static("order-7-refund"))]);
}

#[tokio::test]
async fn header_name_and_methods_are_configurable() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let echo = service_fn({
        let seen = seen.clone();
        move |request: Request<Full<Bytes>>| {
            seen.lock()
                .unwrap()
                .push((request.headers().get("x-idem").is_some(), request.headers().get(IDEMPOTENCY_KEY).is_some()));
            std::future::ready(Ok::<_, Infallible>(()))
        }
    });
    let service =
        IdempotencyKeyLayer::new().header_name(HeaderName::from_static("x-idem")).methods([Method::PUT]).layer(echo);
    for method in [Method::PUT, Method::POST] {
        let request = Request::builder().method(method).uri("http://api.test/x").body(Full::default()).unwrap();
        service.clone().oneshot(request).await.unwrap();
    }
    assert_eq!(*seen.lock().unwrap(), [(true, false), (false, false)]);
}

#[tokio::test]
async fn a_generator_derived_from_the_operation_gives_a_restarted_worker_the_same_key() {
    #[derive(Clone)]
    struct Job(&'static str, u32);
    let layer = IdempotencyKeyLayer::new().generator(|request: &Request<Full<Bytes>>| {
        let Job(run_id, order) = request.extensions().get::<Job>().cloned().unwrap();
        let key = Key::derive(&KeyScope::new(run_id, "refund"), &order).unwrap();
        HeaderValue::from_str(&key.to_hex()).unwrap()
    });
    let api = Api::default();
    for job in [Job("run-1", 7), Job("run-1", 7), Job("run-1", 8), Job("run-2", 7)] {
        // Each call stands for a separate life of the worker: a fresh service stack.
        let mut request = post();
        request.extensions_mut().insert(job);
        layer.layer(api.service(0)).oneshot(request).await.unwrap();
    }
    let keys = api.keys();
    let expected = Key::derive(&KeyScope::new("run-1", "refund"), &7).unwrap().to_hex();
    assert_eq!(keys[0].as_ref().unwrap(), expected.as_str());
    assert_eq!(keys[0], keys[1], "same operation, same key, across lives");
    assert_eq!(keys.iter().collect::<HashSet<_>>().len(), 3, "other payloads and runs get other keys");
}

#[tokio::test(start_paused = true)]
async fn outside_the_retry_layer_every_attempt_carries_the_same_key() {
    let api = Api::default();
    let client = ServiceBuilder::new()
        .layer(IdempotencyKeyLayer::new())
        .layer(RetryLayer::new(policy()))
        .service(api.service(3));
    let response = client.oneshot(post()).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let keys = api.keys();
    assert_eq!(keys.len(), 4);
    assert!(keys[0].is_some() && keys.iter().all(|k| k == &keys[0]), "{keys:?}");
}

/// A policy that retries every failure of every request, as hand-written policies often do.
#[derive(Clone)]
struct Naive(u32);

impl<B: Clone> Policy<Request<B>, Response<()>, Infallible> for Naive {
    type Future = std::future::Ready<()>;

    fn retry(&mut self, _: &mut Request<B>, result: &mut Result<Response<()>, Infallible>) -> Option<Self::Future> {
        let failed = result.as_ref().is_ok_and(|r| r.status().is_server_error());
        (failed && self.0 > 0).then(|| {
            self.0 -= 1;
            std::future::ready(())
        })
    }

    fn clone_request(&mut self, request: &Request<B>) -> Option<Request<B>> {
        Some(request.clone())
    }
}

#[tokio::test]
async fn inside_the_retry_layer_every_attempt_gets_a_new_key() {
    let api = Api::default();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(Naive(5)))
        .layer(IdempotencyKeyLayer::new())
        .service(api.service(3));
    client.oneshot(post()).await.unwrap();
    let keys = api.keys();
    assert_eq!(keys.len(), 4);
    assert_eq!(keys.iter().collect::<HashSet<_>>().len(), 4, "a new key per attempt: the server sees four requests");
}

#[tokio::test(start_paused = true)]
async fn inside_the_retry_layer_the_http_policy_refuses_to_retry_the_unkeyed_post() {
    let api = Api::default();
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(policy()))
        .layer(IdempotencyKeyLayer::new())
        .service(api.service(3));
    let response = client.oneshot(post()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE, "fails safe: the policy saw a POST without a key");
    assert_eq!(api.keys().len(), 1);
}
