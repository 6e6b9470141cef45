//! A process's HTTP port (`--metrics-listen`): Prometheus metrics and, on the coordinator, the
//! dashboard and its JSON API, beside the gRPC port.
//!
//! # What is open
//! - Open routes (`/metrics`, `/healthz`, the dashboard's static files) answer anyone: metrics
//!   are what Prometheus scrapes (it cannot be given the cluster token without a secret in its
//!   config), and the static files are the same for every cluster.
//! - Protected routes (the JSON API: job names, worker addresses, losses) need
//!   `Authorization: Bearer <cluster token>` unless the port is bound to a loopback address,
//!   where only this machine's users can reach it. A missing or wrong token gets `401` with a
//!   JSON `{"error": ...}` body, logged at most once per [`REFUSAL_LOG_INTERVAL`].
//!
//! Plain HTTP: there is no TLS on this port. Bind it to loopback or a private network, as
//! Prometheus exporters usually are.
//!
//! Connections are accepted by Keel's bounded accept loop ([`crate::incoming`]), so a flood of
//! connections cannot exhaust the process's file descriptors here either.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::net::TcpListener;
use tokio_stream::StreamExt;

use crate::auth::ClusterToken;
use crate::connection::LimitedConnection;
use crate::incoming::{ConnectionLimits, Incoming};
use crate::ratelimit::LogLimit;

/// At most one log line per this interval about refused API calls.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);
static REFUSED_LOG: LogLimit = LogLimit::new(REFUSAL_LOG_INTERVAL);

/// The content type of the OpenMetrics text format 1.0.0: what `prometheus-client`'s text
/// encoder writes (`# EOF` at the end, counters as `_total` samples of a base name), and the
/// first format Prometheus asks for.
pub const PROMETHEUS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `--metrics-listen` flag of the coordinator and the workers.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct MetricsArgs {
    /// Address for the HTTP port serving Prometheus metrics at `/metrics` (and, on the
    /// coordinator, the dashboard at `/`). Off when not given. `/metrics` and `/healthz` need
    /// no token; the dashboard's API needs the cluster token unless the address is loopback.
    #[arg(
        long = "metrics-listen",
        env = "KEEL_METRICS_LISTEN",
        value_name = "ADDR"
    )]
    pub metrics_listen: Option<String>,
}

impl MetricsArgs {
    /// The address to serve at: `None` when the flag is not given or empty.
    pub fn addr(&self) -> Option<&str> {
        self.metrics_listen
            .as_deref()
            .map(str::trim)
            .filter(|a| !a.is_empty())
    }

    /// Binds the HTTP port when the flag is given and not empty (`KEEL_METRICS_LISTEN=` is
    /// off, as when unset).
    ///
    /// Errors: a message naming the address when it cannot be bound.
    pub async fn bind(&self) -> Result<Option<TcpListener>, std::io::Error> {
        match self.addr() {
            None => Ok(None),
            Some(addr) => TcpListener::bind(addr).await.map(Some).map_err(|e| {
                std::io::Error::new(e.kind(), format!("--metrics-listen {addr}: {e}"))
            }),
        }
    }
}

/// The routes of an HTTP port: `open` ones answer anyone, `protected` ones need the token
/// unless the port is on loopback.
pub struct Routes {
    /// Metrics, health, static files.
    pub open: Router,
    /// The JSON API.
    pub protected: Router,
}

/// Whether `addr` can be reached only from this machine (127.0.0.0/8, ::1, and IPv4 loopback
/// mapped into IPv6).
pub fn is_loopback(addr: &SocketAddr) -> bool {
    match addr.ip() {
        std::net::IpAddr::V4(ip) => ip.is_loopback(),
        std::net::IpAddr::V6(ip) => {
            ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// Serves `routes` on `listener` until `shutdown` resolves, accepting connections within
/// `limits`. Logs `metrics listening addr=...` once (tests and scripts read the port from it
/// when they bind port 0).
///
/// Errors: the listener's address cannot be read, or the server fails.
pub async fn serve(
    listener: TcpListener,
    token: ClusterToken,
    limits: ConnectionLimits,
    routes: Routes,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), std::io::Error> {
    let addr = listener.local_addr()?;
    let loopback = is_loopback(&addr);
    let protected = if loopback {
        routes.protected
    } else {
        routes
            .protected
            .layer(axum::middleware::from_fn_with_state(token, require_token))
    };
    let app = routes.open.merge(protected);
    tracing::info!(%addr, token_required = !loopback, "metrics listening");
    let listener = BoundedListener {
        incoming: Incoming::new(listener, limits),
        addr,
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// A JSON error body with `status`: `{"error": message}`.
pub fn json_error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = serde_json::json!({ "error": message.into() });
    (status, axum::Json(body)).into_response()
}

/// Refuses a request without `Authorization: Bearer <token>` (constant-time comparison).
async fn require_token(
    State(token): State<ClusterToken>,
    request: Request,
    next: Next,
) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
    match presented {
        Some(p) if token.matches(p) => next.run(request).await,
        other => {
            let reason = if other.is_some() {
                "wrong cluster token"
            } else {
                "no cluster token (send Authorization: Bearer <token>)"
            };
            if let Some(suppressed) = REFUSED_LOG.check() {
                tracing::warn!(path = %request.uri().path(), suppressed, "HTTP request refused: {reason}");
            }
            json_error(StatusCode::UNAUTHORIZED, reason)
        }
    }
}

/// [`Incoming`] as an axum listener.
struct BoundedListener {
    incoming: Incoming,
    addr: SocketAddr,
}

impl axum::serve::Listener for BoundedListener {
    type Io = LimitedConnection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            // `Incoming` never ends and never yields an error (it retries accept errors).
            if let Some(Ok(conn)) = self.incoming.next().await {
                let remote = conn.remote_addr().unwrap_or(self.addr);
                return (conn, remote);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_addresses_are_told_apart() {
        let yes = [
            "127.0.0.1:1",
            "127.3.4.5:1",
            "[::1]:1",
            "[::ffff:127.0.0.1]:1",
        ];
        let no = ["0.0.0.0:1", "10.0.0.1:1", "[::]:1", "[::ffff:10.0.0.1]:1"];
        for a in yes {
            assert!(is_loopback(&a.parse().expect("address")), "{a}");
        }
        for a in no {
            assert!(!is_loopback(&a.parse().expect("address")), "{a}");
        }
    }
}
