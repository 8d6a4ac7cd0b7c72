//! The state endpoint: `GET /state` (JSON, from the ledger) and `GET /ready`.

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
