//! What a worker process runs with ([`Config`]), made from its flags (`super::Args`).

use crate::faults::Faults;
use keel_net::security::{ClientSecurity, ServerSecurity};
use std::path::PathBuf;

/// What [`run`](super::run) needs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The coordinator, host:port.
    pub coordinator: String,
    /// host:port peers reach this worker at.
    pub advertise_addr: String,
    /// Compute threads.
    pub threads: usize,
    /// Cache folder.
    pub cache_dir: PathBuf,
    /// What the ring server requires (token, TLS).
    pub server_security: ServerSecurity,
    /// How this worker calls the coordinator and its ring peers (token, TLS).
    pub client_security: ClientSecurity,
    /// Fault injection for tests (from [`super::Args::fault_nan_at_step`] and
    /// [`super::Args::fault_bad_frame_at_step`]); [`Faults::none`] otherwise.
    pub faults: Faults,
    /// Bytes of memory a job may use here (see [`super::Args::memory_limit`]); `None`: unknown, not
    /// checked.
    pub memory_limit: Option<u64>,
    /// Where to serve `/metrics` ([`crate::telemetry`]; `--metrics-listen`); `None`: off.
    pub metrics_listen: Option<String>,
    /// TLS for that port (the ring's certificate); `None`: plain HTTP.
    pub metrics_tls: Option<std::sync::Arc<keel_net::rustls::ServerConfig>>,
}
