//! The state endpoint: `GET /state` (JSON, from the ledger), `GET /ready` and `GET /metrics`
//! (Prometheus' text format, crate::metrics).

use crate::state::Ledger;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::Value;

pub async fn serve(listener: tokio::net::TcpListener, ledger: Ledger) -> Result<(), String> {
    let app = Router::new()
        .route("/state", get(state))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .with_state(ledger);
    axum::serve(listener, app)
        .await
        .map_err(|e| format!("state endpoint: {e}"))
}

async fn state(State(ledger): State<Ledger>) -> Json<Value> {
    Json(ledger.report())
}

async fn ready(State(ledger): State<Ledger>) -> (StatusCode, &'static str) {
    if ledger.ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the source has not been read yet\n",
        )
    }
}

async fn metrics(State(ledger): State<Ledger>) -> impl axum::response::IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        crate::metrics::render(&ledger),
    )
}
