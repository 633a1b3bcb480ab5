//! Deterministic tests: scripted services under tower's `Retry`, paused tokio time.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response};
use http_body_util::Full;
use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};
use tower::retry::{Policy, RetryLayer};
use tower::{ServiceBuilder, ServiceExt, service_fn};

use super::{Backoff, GrpcCode, GrpcRetryPolicy, HttpRetryPolicy, retry_after};
use crate::header::key_digest;

/// An error from the scripted service.
#[derive(Debug, Clone, PartialEq)]
struct TestError {
    transient: bool,
}

type Outcome = Result<Response<()>, TestError>;

#[derive(Debug, Clone)]
struct Call {
    at: Instant,
    key: Option<HeaderValue>,
}

#[derive(Clone, Default)]
struct Calls(Arc<Mutex<Vec<Call>>>);

impl Calls {
    fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    fn gaps(&self) -> Vec<Duration> {
        let calls = self.0.lock().unwrap();
        calls.windows(2).map(|w| w[1].at - w[0].at).collect()
    }

    fn keys(&self) -> Vec<Option<HeaderValue>> {
        self.0.lock().unwrap().iter().map(|c| c.key.clone()).collect()
    }
}

fn status(code: u16) -> Outcome {
    Ok(Response::builder().status(code).body(()).unwrap())
}

fn status_with(code: u16, name: &'static str, value: &str) -> Outcome {
    Ok(Response::builder().status(code).header(name, value).body(()).unwrap())
}

fn error(transient: bool) -> Outcome {
    Err(TestError { transient })
}

/// Sends `request` through `Retry<policy>` over a service that answers with `script`, then 200.
async fn run<P>(policy: P, request: Request<Full<Bytes>>, script: Vec<Outcome>) -> (Outcome, Calls)
where
    P: Policy<Request<Full<Bytes>>, Response<()>, TestError> + Clone,
{
    let calls = Calls::default();
    let service = scripted(script, calls.clone());
    let result = ServiceBuilder::new().layer(RetryLayer::new(policy)).service(service).oneshot(request).await;
    (result, calls)
}

fn scripted(
    script: Vec<Outcome>,
    calls: Calls,
) -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<()>,
    Error = TestError,
    Future = std::future::Ready<Outcome>,
> + Clone {
    let script = Arc::new(Mutex::new(VecDeque::from(script)));
    service_fn(move |request: Request<Full<Bytes>>| {
        calls
            .0
            .lock()
            .unwrap()
            .push(Call { at: Instant::now(), key: request.headers().get("idempotency-key").cloned() });
        std::future::ready(script.lock().unwrap().pop_front().unwrap_or_else(|| status(200)))
    })
}

fn get() -> Request<Full<Bytes>> {
    Request::get("http://api.test/orders/7").body(Full::default()).unwrap()
}

fn post_with_key() -> Request<Full<Bytes>> {
    Request::post("http://api.test/refunds")
        .header("idempotency-key", "\"k-1\"")
        .body(Full::from("{\"order\":7}"))
        .unwrap()
}

fn fast() -> Backoff {
    Backoff::new(Duration::from_millis(10), Duration::from_millis(100))
}

#[tokio::test(start_paused = true)]
async fn delays_between_attempts_stay_under_the_backoff_ceiling() {
    let backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(500)).max_attempts(6);
    let policy = HttpRetryPolicy::new().backoff(backoff).jitter_seed(1);
    let (result, calls) = run(policy, get(), vec![status(503); 10]).await;
    assert_eq!(result.unwrap().status(), 503, "the last answer is returned once attempts run out");
    assert_eq!(calls.count(), 6);
    for (n, gap) in calls.gaps().into_iter().enumerate() {
        assert!(gap <= backoff.ceiling(n as u32), "gap {n} was {gap:?}, above {:?}", backoff.ceiling(n as u32));
    }
}

#[tokio::test(start_paused = true)]
async fn a_seed_makes_the_delays_reproducible_and_different_seeds_differ() {
    let backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60)).max_attempts(6);
    let mut runs = Vec::new();
    for seed in [42, 42, 43] {
        let (_, calls) =
            run(HttpRetryPolicy::new().backoff(backoff).jitter_seed(seed), get(), vec![status(503); 5]).await;
        runs.push(calls.gaps());
    }
    assert_eq!(runs[0], runs[1]);
    assert_ne!(runs[0], runs[2]);
}

/// The delay a policy seeded with `seed` adds to a server-requested `wait` on its first retry.
fn seeded_jitter(seed: u64, wait: Duration) -> Duration {
    Backoff::hint_jitter(wait, fastrand::Rng::with_seed(seed).u64(..))
}

#[tokio::test(start_paused = true)]
async fn retry_after_in_seconds_is_waited_plus_a_small_jitter() {
    let policy = HttpRetryPolicy::new().backoff(fast()).jitter_seed(11);
    let (result, calls) = run(policy, get(), vec![status_with(503, "retry-after", "7")]).await;
    assert_eq!(result.unwrap().status(), 200);
    let wait = Duration::from_secs(7);
    assert_eq!(calls.gaps(), [wait + seeded_jitter(11, wait)]);
    assert!(calls.gaps()[0] <= wait + Duration::from_millis(250));
}

#[tokio::test(start_paused = true)]
async fn clients_told_the_same_retry_after_do_not_come_back_together() {
    let mut gaps = Vec::new();
    for seed in 0..64 {
        let policy = HttpRetryPolicy::new().backoff(fast()).jitter_seed(seed);
        let (_, calls) = run(policy, post_with_key(), vec![status_with(409, "retry-after", "1")]).await;
        let gap = calls.gaps()[0];
        assert!(gap >= Duration::from_secs(1), "retried before Retry-After: {gap:?}");
        assert!(gap <= Duration::from_millis(1100), "a tenth of the wait at most: {gap:?}");
        gaps.push(gap);
    }
    gaps.sort();
    gaps.dedup();
    assert!(gaps.len() > 32, "64 clients retried at only {} distinct instants", gaps.len());
    assert!(gaps[gaps.len() - 1] - gaps[0] > Duration::from_millis(50), "spread: {gaps:?}");
}

#[test]
fn retry_after_jitter_is_a_tenth_of_the_wait_within_50_to_250_ms() {
    let mut rng = fastrand::Rng::with_seed(5);
    let max = |wait: Duration, rng: &mut fastrand::Rng| {
        (0..2000).map(|_| Backoff::hint_jitter(wait, rng.u64(..))).max().unwrap()
    };
    let near = |d: Duration, ms: u64| d <= Duration::from_millis(ms) && d > Duration::from_millis(ms * 9 / 10);
    assert!(near(max(Duration::ZERO, &mut rng), 50));
    assert!(near(max(Duration::from_secs(1), &mut rng), 100));
    assert!(near(max(Duration::from_secs(60), &mut rng), 250));
    assert!(near(max(Duration::MAX, &mut rng), 250));
}

#[tokio::test(start_paused = true)]
async fn retry_after_as_an_http_date_is_waited_until() {
    let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(50));
    let policy = HttpRetryPolicy::new().backoff(fast());
    let (result, calls) = run(policy, get(), vec![status_with(429, "retry-after", &date)]).await;
    assert_eq!(result.unwrap().status(), 200);
    let gap = calls.gaps()[0];
    // HTTP-dates have whole seconds; the wall clock moved on a little since `date` was made; the
    // jitter adds up to 250 ms.
    assert!(gap > Duration::from_secs(48) && gap <= Duration::from_millis(50_250), "waited {gap:?}");
}

#[tokio::test(start_paused = true)]
async fn retry_after_longer_than_the_maximum_returns_the_response() {
    let policy = HttpRetryPolicy::new().backoff(fast()).max_retry_after(Duration::from_secs(30));
    let (result, calls) = run(policy, get(), vec![status_with(503, "retry-after", "3600")]).await;
    assert_eq!(result.unwrap().status(), 503);
    assert_eq!(calls.count(), 1);
}

#[test]
fn retry_after_parses_both_forms_and_ignores_garbage() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let parse = |value: &str| {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::RETRY_AFTER, HeaderValue::from_str(value).unwrap());
        retry_after(&headers, now)
    };
    assert_eq!(parse("0"), Some(Duration::ZERO));
    assert_eq!(parse(" 12 "), Some(Duration::from_secs(12)));
    assert_eq!(parse(&httpdate::fmt_http_date(now + Duration::from_secs(90))), Some(Duration::from_secs(90)));
    assert_eq!(
        parse(&httpdate::fmt_http_date(now - Duration::from_secs(90))),
        Some(Duration::ZERO),
        "a past date means now"
    );
    assert_eq!(parse("-3"), None);
    assert_eq!(parse("soon"), None);
    assert_eq!(retry_after(&HeaderMap::new(), now), None);
}

#[tokio::test(start_paused = true)]
async fn an_empty_budget_allows_no_retries() {
    // No reserve and no percentage: tower's TpsBudget never has a retry to give.
    let policy = HttpRetryPolicy::new().backoff(fast()).budget(TpsBudget::new(Duration::from_secs(60), 0, 0.0));
    let (result, calls) = run(policy, get(), vec![status(503); 3]).await;
    assert_eq!(result.unwrap().status(), 503);
    assert_eq!(calls.count(), 1);
}

#[tokio::test(start_paused = true)]
async fn tps_budget_caps_retries_at_its_share_of_requests() {
    // 50%: each request deposits one unit, a retry costs two. No reserve.
    let policy = HttpRetryPolicy::new().backoff(fast().max_attempts(100)).budget(TpsBudget::new(
        Duration::from_secs(60),
        0,
        0.5,
    ));
    let mut total = 0;
    for _ in 0..10 {
        let (_, calls) = run(policy.clone(), get(), vec![status(503); 1000]).await;
        total += calls.count();
    }
    assert_eq!(total, 10 + 5, "10 requests earn 5 retries, however many attempts each may make");
}

/// A budget that holds a fixed number of retries.
struct Fixed(AtomicU32);

impl Budget for Fixed {
    fn deposit(&self) {}

    fn withdraw(&self) -> bool {
        self.0.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
    }
}

#[tokio::test(start_paused = true)]
async fn exhausting_the_budget_stops_retries_across_requests() {
    let policy = HttpRetryPolicy::new().backoff(fast().max_attempts(10)).budget(Fixed(AtomicU32::new(3)));
    let (first, calls) = run(policy.clone(), get(), vec![status(503); 2]).await;
    assert_eq!(first.unwrap().status(), 200);
    assert_eq!(calls.count(), 3, "two retries taken from the budget");
    let (second, calls) = run(policy.clone(), get(), vec![status(503); 5]).await;
    assert_eq!(second.unwrap().status(), 503, "the last retry in the budget was not enough");
    assert_eq!(calls.count(), 2);
    let (_, calls) = run(policy, get(), vec![status(503)]).await;
    assert_eq!(calls.count(), 1, "the budget is shared by clones and is empty now");
}

#[tokio::test(start_paused = true)]
async fn max_attempts_bounds_one_request() {
    let (result, calls) =
        run(HttpRetryPolicy::new().backoff(fast().max_attempts(3)), post_with_key(), vec![error(true); 9]).await;
    assert_eq!(result.unwrap_err(), TestError { transient: true });
    assert_eq!(calls.count(), 3);
}

#[tokio::test(start_paused = true)]
async fn transient_statuses_are_retried() {
    let mut cases: Vec<(String, Outcome)> =
        [408, 425, 429, 500, 502, 503, 504].into_iter().map(|code| (code.to_string(), status(code))).collect();
    cases.push(("409 in flight".into(), status_with(409, "retry-after", "1")));
    for (name, outcome) in cases {
        let (result, calls) = run(HttpRetryPolicy::new().backoff(fast()), post_with_key(), vec![outcome]).await;
        assert_eq!(result.unwrap().status(), 200, "{name}");
        assert_eq!(calls.count(), 2, "{name} is retried once, then succeeds");
    }
}

#[tokio::test(start_paused = true)]
async fn permanent_statuses_are_not_retried() {
    for code in [400, 401, 403, 404, 409, 413, 422, 501, 505] {
        let (result, calls) = run(HttpRetryPolicy::new().backoff(fast()), post_with_key(), vec![status(code)]).await;
        assert_eq!(result.unwrap().status(), code);
        assert_eq!(calls.count(), 1, "{code} must not be retried");
    }
    // Even a 422 that (oddly) carries Retry-After is final.
    let (_, calls) =
        run(HttpRetryPolicy::new().backoff(fast()), post_with_key(), vec![status_with(422, "retry-after", "1")]).await;
    assert_eq!(calls.count(), 1);
}

#[tokio::test(start_paused = true)]
async fn errors_are_retried_unless_the_classifier_calls_them_permanent() {
    let (result, calls) = run(HttpRetryPolicy::new().backoff(fast()), get(), vec![error(false)]).await;
    assert_eq!(result.unwrap().status(), 200, "by default every error is transient");
    assert_eq!(calls.count(), 2);

    let policy = HttpRetryPolicy::new().backoff(fast()).classify_errors(|e: &TestError| e.transient);
    let (result, calls) = run(policy.clone(), get(), vec![error(false)]).await;
    assert_eq!(result.unwrap_err(), TestError { transient: false });
    assert_eq!(calls.count(), 1);
    let (result, calls) = run(policy, get(), vec![error(true)]).await;
    assert!(result.is_ok());
    assert_eq!(calls.count(), 2);
}

#[tokio::test(start_paused = true)]
async fn non_idempotent_requests_without_a_key_are_not_retried() {
    for method in [Method::POST, Method::PATCH, Method::from_bytes(b"PURGE").unwrap()] {
        let request = Request::builder().method(method.clone()).uri("http://api.test/x").body(Full::default()).unwrap();
        let (result, calls) = run(HttpRetryPolicy::new().backoff(fast()), request, vec![error(true)]).await;
        assert!(result.is_err(), "{method}: the error is returned, not retried");
        assert_eq!(calls.count(), 1, "{method}");
    }
    for method in [Method::GET, Method::HEAD, Method::OPTIONS, Method::PUT, Method::DELETE] {
        let request = Request::builder().method(method.clone()).uri("http://api.test/x").body(Full::default()).unwrap();
        let (_, calls) = run(HttpRetryPolicy::new().backoff(fast()), request, vec![error(true)]).await;
        assert_eq!(calls.count(), 2, "{method} is idempotent and retried without a key");
    }
    let (_, calls) = run(HttpRetryPolicy::new().backoff(fast()), post_with_key(), vec![error(true)]).await;
    assert_eq!(calls.count(), 2, "a POST with a key is retried");
    assert_eq!(calls.keys()[0], calls.keys()[1], "with the same key");
}

#[tokio::test(start_paused = true)]
async fn the_key_header_is_configurable() {
    let request = Request::post("http://api.test/x").header("x-request-key", "abc").body(Full::default()).unwrap();
    let (_, calls) = run(HttpRetryPolicy::new().backoff(fast()), request.clone(), vec![status(503)]).await;
    assert_eq!(calls.count(), 1, "not the default header: no key");
    let policy = HttpRetryPolicy::new().backoff(fast()).key_header(HeaderName::from_static("x-request-key"));
    let (_, calls) = run(policy, request, vec![status(503)]).await;
    assert_eq!(calls.count(), 2);
}

fn grpc_call() -> Request<Full<Bytes>> {
    Request::post("http://api.test/payments.v1.Payments/Refund")
        .header("content-type", "application/grpc")
        .header("idempotency-key", "k-1")
        .body(Full::new(Bytes::from_static(b"\0\0\0\0\0")))
        .unwrap()
}

fn grpc_status(code: GrpcCode) -> Outcome {
    Ok(Response::builder()
        .header("content-type", "application/grpc")
        .header("grpc-status", code.get().to_string())
        .body(())
        .unwrap())
}

#[tokio::test(start_paused = true)]
async fn grpc_unavailable_aborted_and_exhausted_are_retried() {
    for code in [GrpcCode::UNAVAILABLE, GrpcCode::ABORTED, GrpcCode::RESOURCE_EXHAUSTED] {
        let (result, calls) = run(GrpcRetryPolicy::new().backoff(fast()), grpc_call(), vec![grpc_status(code)]).await;
        assert_eq!(result.unwrap().status(), 200);
        assert_eq!(calls.count(), 2, "{code:?}");
    }
    let (_, calls) = run(GrpcRetryPolicy::new().backoff(fast()), grpc_call(), vec![status(503)]).await;
    assert_eq!(calls.count(), 2, "HTTP 503 from a proxy is UNAVAILABLE");
    let (_, calls) = run(GrpcRetryPolicy::new().backoff(fast()), grpc_call(), vec![error(true)]).await;
    assert_eq!(calls.count(), 2, "a transport error is retried");
}

#[tokio::test(start_paused = true)]
async fn grpc_permanent_codes_and_completed_calls_are_not_retried() {
    for code in [
        GrpcCode::INVALID_ARGUMENT,
        GrpcCode::FAILED_PRECONDITION,
        GrpcCode::PERMISSION_DENIED,
        GrpcCode::UNAUTHENTICATED,
        GrpcCode::UNIMPLEMENTED,
        GrpcCode::INTERNAL,
        GrpcCode::DEADLINE_EXCEEDED,
        GrpcCode::new(0),
    ] {
        let (_, calls) = run(GrpcRetryPolicy::new().backoff(fast()), grpc_call(), vec![grpc_status(code)]).await;
        assert_eq!(calls.count(), 1, "{code:?} must not be retried");
    }
    // A streamed response: the status comes in the trailers, the call ran.
    let (_, calls) = run(GrpcRetryPolicy::new().backoff(fast()), grpc_call(), vec![status(200)]).await;
    assert_eq!(calls.count(), 1);
    // The code set is configurable.
    let policy = GrpcRetryPolicy::new().backoff(fast()).retry_codes([GrpcCode::DEADLINE_EXCEEDED]);
    let (_, calls) = run(policy.clone(), grpc_call(), vec![grpc_status(GrpcCode::DEADLINE_EXCEEDED)]).await;
    assert_eq!(calls.count(), 2);
    let (_, calls) = run(policy, grpc_call(), vec![grpc_status(GrpcCode::UNAVAILABLE)]).await;
    assert_eq!(calls.count(), 1);
}

#[tokio::test(start_paused = true)]
async fn grpc_calls_without_a_key_are_not_retried() {
    let mut call = grpc_call();
    call.headers_mut().remove("idempotency-key");
    let (_, calls) = run(GrpcRetryPolicy::new().backoff(fast()), call, vec![grpc_status(GrpcCode::UNAVAILABLE)]).await;
    assert_eq!(calls.count(), 1);
}

#[tokio::test(start_paused = true)]
async fn grpc_pushback_is_honoured_and_a_negative_one_stops() {
    let pushback = |ms: &str| {
        Ok(Response::builder().header("grpc-status", "14").header("grpc-retry-pushback-ms", ms).body(()).unwrap())
    };
    let policy = GrpcRetryPolicy::new().backoff(fast()).jitter_seed(4);
    let (_, calls) = run(policy, grpc_call(), vec![pushback("2500")]).await;
    let wait = Duration::from_millis(2500);
    assert_eq!(calls.gaps(), [wait + seeded_jitter(4, wait)]);
    let (result, calls) = run(GrpcRetryPolicy::new().backoff(fast()), grpc_call(), vec![pushback("-1")]).await;
    assert_eq!(result.unwrap().headers()["grpc-status"], "14");
    assert_eq!(calls.count(), 1);
    let aborted_with_retry_after =
        Ok(Response::builder().header("grpc-status", "10").header("retry-after", "3").body(()).unwrap());
    let policy = GrpcRetryPolicy::new().backoff(fast()).jitter_seed(9);
    let (_, calls) = run(policy, grpc_call(), vec![aborted_with_retry_after]).await;
    assert_eq!(calls.gaps(), [Duration::from_secs(3) + seeded_jitter(9, Duration::from_secs(3))]);
}

/// Collects every event's fields as text.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<String>>>);

impl tracing::Subscriber for Recorder {
    // Tests on other threads run with no subscriber; "sometimes" makes every callsite ask each
    // time instead of caching an answer that another thread's dispatcher gave.
    fn register_callsite(&self, _: &'static tracing::Metadata<'static>) -> tracing::subscriber::Interest {
        tracing::subscriber::Interest::sometimes()
    }
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!("{}={:?} ", field.name(), value));
            }
        }
        let mut text = Text(String::new());
        event.record(&mut text);
        self.0.lock().unwrap().push(text.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[tokio::test(start_paused = true)]
async fn retries_and_give_ups_are_logged_with_the_hashed_key_only() {
    let recorder = Recorder::default();
    // Other tests run on other threads of this process with no subscriber of their own. With a
    // process-wide subscriber that is always interested, no thread can leave a callsite cached
    // as "never", which would hide this test's events from its thread-local recorder.
    static GLOBAL: std::sync::Once = std::sync::Once::new();
    GLOBAL.call_once(|| {
        let _ = tracing::subscriber::set_global_default(Recorder::default());
    });
    let _guard = tracing::subscriber::set_default(recorder.clone());
    tracing::callsite::rebuild_interest_cache();
    let raw = "\"k-1\"";
    let (_, calls) =
        run(HttpRetryPolicy::new().backoff(fast().max_attempts(2)), post_with_key(), vec![status(503); 2]).await;
    assert_eq!(calls.count(), 2);

    let events = recorder.0.lock().unwrap().clone();
    let digest = key_digest(&HeaderValue::from_static(raw));
    assert_eq!(digest.len(), 12);
    let retry = events.iter().find(|e| e.contains("idempotent.retry")).expect("a retry event");
    assert!(
        retry.contains(&format!("key={digest} ")) && retry.contains("attempt=2") && retry.contains("delay_ms="),
        "{retry}"
    );
    let give_up = events.iter().find(|e| e.contains("idempotent.give_up")).expect("a give-up event");
    assert!(give_up.contains("attempts exhausted") && give_up.contains(&digest), "{give_up}");
    assert!(events.iter().all(|e| !e.contains("k-1")), "the raw key leaked into the logs: {events:?}");
}
