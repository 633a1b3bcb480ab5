//! The refund service the client tests (`tests/tests/tower_client.rs`, `reqwest_client.rs`)
//! send their logical requests to: an axum route behind the server `IdempotencyLayer`, which
//! records every refund it makes, and the proxy rule that loses the first replies of each
//! logical request.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body as AxumBody;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::post;
use http::{HeaderMap, Response, StatusCode};
use idempotent_core::SharedStore;
use idempotent_tower::server::IdempotencyLayer;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tower::util::MapResponseLayer;

/// Every refund the handler made: order → the idempotency keys it ran under.
#[derive(Clone, Default)]
pub struct Refunds {
    runs: Arc<Mutex<HashMap<u32, Vec<String>>>>,
    /// Notified when the server answers 409 (a duplicate refused while the first one runs).
    pub in_flight_refused: Arc<Notify>,
    /// The first `overloaded` answers (after the refund was made) are replaced by 429s with
    /// `Retry-After: 1`.
    pub overloaded: Arc<AtomicU32>,
}

impl Refunds {
    /// How many refunds the order got.
    pub fn effects(&self, order: u32) -> usize {
        self.runs.lock().unwrap().get(&order).map_or(0, Vec::len)
    }

    /// The keys the order's refunds ran under.
    pub fn keys(&self, order: u32) -> HashSet<String> {
        self.runs.lock().unwrap().get(&order).map(|keys| keys.iter().cloned().collect()).unwrap_or_default()
    }

    /// How many refunds were made in all.
    pub fn total(&self) -> usize {
        self.runs.lock().unwrap().values().map(Vec::len).sum()
    }
}

/// `POST /refunds` with `{"order": n}`: one refund, named by the order and its count; with
/// `"wait_for_duplicate": true`, it waits until the server has refused a duplicate with 409.
async fn refund(State(refunds): State<Refunds>, headers: HeaderMap, body: String) -> (StatusCode, String) {
    let request: serde_json::Value = serde_json::from_str(&body).expect("a JSON body");
    let order = request["order"].as_u64().expect("an order number") as u32;
    if request["wait_for_duplicate"] == true {
        tokio::time::timeout(Duration::from_secs(10), refunds.in_flight_refused.notified())
            .await
            .expect("the duplicate was refused with 409 while this refund ran");
    }
    let key = headers.get("idempotency-key").map(|k| k.to_str().unwrap().to_owned()).unwrap_or_default();
    let n = {
        let mut runs = refunds.runs.lock().unwrap();
        let keys = runs.entry(order).or_default();
        keys.push(key);
        keys.len()
    };
    (StatusCode::CREATED, format!("{{\"refund\":\"re_{order}_{n}\"}}"))
}

/// Serves the refund route behind `IdempotencyLayer::new(store)` on a free loopback port.
pub async fn start_refund_server(store: SharedStore) -> (SocketAddr, Refunds) {
    let refunds = Refunds::default();
    let (refused, overloaded) = (refunds.in_flight_refused.clone(), refunds.overloaded.clone());
    let app = Router::new()
        .route("/refunds", post(refund))
        .with_state(refunds.clone())
        .layer(IdempotencyLayer::new(store))
        .layer(MapResponseLayer::new(move |response: Response<AxumBody>| {
            if response.status() == StatusCode::CONFLICT {
                refused.notify_one();
            }
            if overloaded.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
                return (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")], "slow down").into_response();
            }
            response
        }));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, refunds)
}

/// A proxy rule that loses the first `drops_for(n)` replies of the logical request `n` (its
/// `x-logical-request` header, which every attempt carries).
pub fn lose_first_replies(drops_for: fn(u32) -> u32) -> impl Fn(&str) -> bool + Send + Sync + 'static {
    let attempts = Mutex::new(HashMap::<u32, u32>::new());
    move |head: &str| {
        let n: u32 = head
            .lines()
            .find_map(|line| line.to_ascii_lowercase().strip_prefix("x-logical-request:").map(|v| v.trim().to_owned()))
            .expect("every test request names its logical request")
            .parse()
            .unwrap();
        let mut attempts = attempts.lock().unwrap();
        let attempt = attempts.entry(n).or_insert(0);
        *attempt += 1;
        *attempt <= drops_for(n)
    }
}

/// What one logical request ended with.
#[derive(Debug)]
pub struct Answer {
    /// The status the client got.
    pub status: StatusCode,
    /// Whether it carried `Idempotent-Replayed: true`.
    pub replayed: bool,
    /// The body.
    pub body: String,
}

/// Asserts that each of the logical requests `0..requests` was answered with its order's first
/// refund (a replay exactly when `drops_for` made the proxy lose a reply of it), and that each
/// order was refunded exactly once.
#[track_caller]
pub fn assert_each_order_refunded_once(
    answers: &HashMap<u32, Result<Answer, String>>,
    refunds: &Refunds,
    requests: u32,
    drops_for: fn(u32) -> u32,
) {
    for order in 0..requests {
        let answer = answers[&order].as_ref().unwrap_or_else(|e| panic!("order {order} failed: {e}"));
        assert_eq!(answer.status, StatusCode::CREATED, "order {order}");
        assert_eq!(answer.body, format!("{{\"refund\":\"re_{order}_1\"}}"), "order {order} sees the first refund");
        assert_eq!(answer.replayed, drops_for(order) > 0, "order {order}: a reply after a loss is the stored one");
        assert_eq!(refunds.effects(order), 1, "order {order} refunded exactly once");
    }
    assert_eq!(refunds.total(), requests as usize);
}
