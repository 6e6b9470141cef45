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

const HTML: &str = "text/html; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

/// The dashboard's files: (path, content type, contents).
static FILES: [(&str, &str, &str); 7] = [
    ("/", HTML, include_str!("../../assets/dashboard/index.html")),
    (
        "/index.html",
        HTML,
        include_str!("../../assets/dashboard/index.html"),
    ),
    (
        "/common.js",
        JS,
        include_str!("../../assets/dashboard/common.js"),
    ),
    (
        "/charts.js",
        JS,
        include_str!("../../assets/dashboard/charts.js"),
    ),
    (
        "/ring.js",
        JS,
        include_str!("../../assets/dashboard/ring.js"),
    ),
    ("/app.js", JS, include_str!("../../assets/dashboard/app.js")),
    (
        "/style.css",
        CSS,
        include_str!("../../assets/dashboard/style.css"),
    ),
];

/// The routes of the coordinator's HTTP port over `shared`.
pub fn routes(shared: Arc<Shared>) -> Routes {
    let mut open = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/healthz", get(|| async { "ok" }));
    for (path, content_type, body) in FILES {
        open = open.route(path, get(move || async move { page(content_type, body) }));
    }
    let open = open.with_state(shared.clone());
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
