//! The payments service of the `axum_payments` example: its refund route behind
//! `IdempotencyLayer`, the provider it calls, and `/metrics`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::extract::State;
use axum::http::{StatusCode, request::Parts};
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotent_core::SharedStore;
use idempotent_tower::IdempotencyLayer;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::{Deserialize, Serialize};

/// The layer's scope on the refund route: the `step` label of its metrics.
pub const SCOPE: &str = "payments";

/// A stand-in for the payment provider: every call is a real refund.
#[derive(Debug, Default)]
pub struct Provider {
    refunds: AtomicU32,
}

impl Provider {
    /// How many refunds the provider issued.
    pub fn refunds(&self) -> u32 {
        self.refunds.load(Ordering::SeqCst)
    }
}

#[derive(Deserialize)]
struct RefundRequest {
    order_id: String,
    amount_cents: i64,
}

#[derive(Serialize)]
struct Refund {
    refund_id: String,
    order_id: String,
    amount_cents: i64,
}

async fn create_refund(
    State(provider): State<Arc<Provider>>,
    Json(req): Json<RefundRequest>,
) -> Result<(StatusCode, Json<Refund>), (StatusCode, String)> {
    if req.amount_cents <= 0 {
        // A final 4xx: stored and replayed like a success.
        return Err((StatusCode::UNPROCESSABLE_ENTITY, "amount_cents must be positive".into()));
    }
    let n = provider.refunds.fetch_add(1, Ordering::SeqCst) + 1;
    let refund = Refund { refund_id: format!("re_{n:04}"), order_id: req.order_id, amount_cents: req.amount_cents };
    Ok((StatusCode::CREATED, Json(refund)))
}

async fn provider_stats(State(provider): State<Arc<Provider>>) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "refunds_issued": provider.refunds() }))
}

/// The account a request acts for. A real service would read it from its authentication layer
/// (placed outside the idempotency layer); this toy trusts the bearer token's text.
fn account(parts: &Parts) -> Option<String> {
    let auth = parts.headers.get("authorization")?.to_str().ok()?;
    auth.strip_prefix("Bearer ").map(str::to_owned)
}

/// The service: `POST /refunds` behind the layer (a key required, the account as the tenant),
/// `GET /provider` (how many refunds were issued) and `GET /metrics` (what the recorder behind
/// `metrics` has, in the Prometheus text format; outside the layer, as any read route).
pub fn app(store: SharedStore, provider: Arc<Provider>, metrics: PrometheusHandle) -> Router {
    let refunds = Router::new()
        .route("/refunds", post(create_refund))
        .layer(IdempotencyLayer::new(store).require_key(true).tenant(account).scope(SCOPE));
    Router::new()
        .merge(refunds)
        .route("/provider", get(provider_stats))
        .with_state(provider)
        .route("/metrics", get(move || std::future::ready(metrics.render())))
}
