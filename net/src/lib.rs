//! Keel's network middleware, shared by the coordinator, the workers and the client: not a
//! contract (that is `keel_proto`), but how every Keel process serves and calls.
//!
//! # Layout
//! - `auth`, `tls`, `security`: the cluster token every call carries, optional TLS, and both
//!   bundled for servers and clients.
//! - `incoming`, `connection`, `slots`: the accept loop every server uses (connection cap,
//!   handshake, auth and idle timeouts, back-off on accept errors), the connections it hands
//!   out, and who holds which slot: connections that proved the token keep theirs, strangers'
//!   are evicted to make room.
//! - `ratelimit`: at most one log line per interval for events strangers can cause.
//! - `admin`: the gRPC health and reflection services every server adds.
//! - `http_port`: the HTTP port (`--metrics-listen`): open metrics, token-guarded API.
//! - `client`: calling the coordinator (its address, a client with Keel's limits), for the
//!   workers and `keel`.

#![warn(missing_docs)]

pub mod admin;
pub mod auth;
pub mod client;
pub mod connection;
pub mod http_port;
pub mod incoming;
pub mod ratelimit;
pub mod security;
pub mod slots;
pub mod tls;

/// The `rustls` this crate builds TLS configs with (for the types in its signatures).
pub use rustls;
