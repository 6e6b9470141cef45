//! The coordinator's HTTP port (`--metrics-listen`): Prometheus metrics, the live dashboard
//! and the JSON API it polls. Served by `keel_net::http_port` (which decides what needs the
//! cluster token).
//!
//! # Layout
//! - `metrics`: `GET /metrics`, built from the machine at each scrape.
//! - `api`: `GET /api/jobs`, `/api/jobs/{job}/metrics`, `/api/workers`.
//! - this file: the routes and the dashboard's static files, built into the binary from
//!   `coordinator/assets/dashboard/` (no front-end build step: plain HTML, CSS and JavaScript):
//!   `index.html`, `style.css` and, loaded in this order as classic scripts sharing the `Keel`
//!   namespace object, `common.js` (formatting, element builders), `charts.js` (the SVG line
//!   charts), `ring.js` (the ring diagram) and `app.js` (polling, state, tables, timeline,
//!   token form).

pub mod api;
pub mod metrics;

use crate::driver::Shared;
use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use keel_net::http_port::{Routes, metrics_reply};
use std::sync::Arc;
use std::time::Instant;

static INDEX_HTML: &str = include_str!("../../assets/dashboard/index.html");
static COMMON_JS: &str = include_str!("../../assets/dashboard/common.js");
static CHARTS_JS: &str = include_str!("../../assets/dashboard/charts.js");
static RING_JS: &str = include_str!("../../assets/dashboard/ring.js");
static APP_JS: &str = include_str!("../../assets/dashboard/app.js");
static STYLE_CSS: &str = include_str!("../../assets/dashboard/style.css");

/// The routes of the coordinator's HTTP port over `shared`.
pub fn routes(shared: Arc<Shared>) -> Routes {
    let open = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/",
            get(|| async { page("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            "/index.html",
            get(|| async { page("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            "/common.js",
            get(|| async { page("text/javascript; charset=utf-8", COMMON_JS) }),
        )
        .route(
            "/charts.js",
            get(|| async { page("text/javascript; charset=utf-8", CHARTS_JS) }),
        )
        .route(
            "/ring.js",
            get(|| async { page("text/javascript; charset=utf-8", RING_JS) }),
        )
        .route(
            "/app.js",
            get(|| async { page("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/style.css",
            get(|| async { page("text/css; charset=utf-8", STYLE_CSS) }),
        )
        .with_state(shared.clone());
    let protected = Router::new()
        .route("/api/jobs", get(api::jobs))
        .route("/api/jobs/{job}/metrics", get(api::job_metrics))
        .route("/api/workers", get(api::workers))
        .with_state(shared);
    Routes { open, protected }
}

/// A static file with its content type; never cached, so a new binary's page is seen at once.
fn page(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
}

/// `GET /metrics`.
async fn metrics_page(
    State(shared): State<Arc<Shared>>,
    headers: axum::http::HeaderMap,
) -> impl IntoResponse {
    let text = shared.read(|m| metrics::encode(m, Instant::now()));
    metrics_reply(&headers, text)
}
