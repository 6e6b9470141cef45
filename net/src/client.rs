//! Calling the coordinator: its address with the default port filled in
//! ([`coordinator_address`]) and a client with Keel's message limits, HTTP/2 windows, token
//! and TLS ([`coordinator_client`]). Used by the workers and by `keel`.

use std::time::Duration;

use keel_proto::protocol::MAX_MESSAGE_BYTES;
use keel_proto::rpc::coordinator_client::CoordinatorClient;

use crate::auth::AuthChannel;
use crate::security::ClientSecurity;

/// The port a coordinator listens on unless told otherwise (`keel-coordinator --listen`).
pub const DEFAULT_COORDINATOR_PORT: u16 = 7070;

/// A coordinator address that cannot be dialled.
#[derive(Debug, thiserror::Error)]
#[error("coordinator {addr}: {reason}")]
pub struct ConnectError {
    /// The address, with the default port filled in.
    pub addr: String,
    /// What is wrong with it.
    pub reason: String,
}

/// `addr` with the coordinator's default port (7070) added when it names only a host
/// (`127.0.0.1`, `node-1`, `[::1]`, `http://node-1`); otherwise unchanged. Without this,
/// `--coordinator 127.0.0.1` would dial port 80 and report "Connection refused".
pub fn coordinator_address(addr: &str) -> String {
    let (scheme, rest) = match addr.find("://") {
        Some(i) => addr.split_at(i + 3),
        None => ("", addr),
    };
    let host = rest.trim_end_matches('/');
    let has_port = if let Some(after) = host.strip_prefix('[') {
        // [v6] or [v6]:port
        after.contains("]:")
    } else {
        // A bare IPv6 address (two or more colons) cannot carry a port without brackets.
        host.matches(':').count() == 1
    };
    let bare_v6 = !host.starts_with('[') && host.matches(':').count() > 1;
    if has_port || host.is_empty() {
        addr.to_string()
    } else if bare_v6 {
        format!("{scheme}[{host}]:{DEFAULT_COORDINATOR_PORT}")
    } else {
        format!("{scheme}{host}:{DEFAULT_COORDINATOR_PORT}")
    }
}

/// A client for `addr` (host:port; a host alone gets port 7070, see [`coordinator_address`])
/// with Keel's message limits and HTTP/2 windows, sending the cluster token on every call,
/// over TLS when `security` says so. Connects lazily; calls fail with `UNAVAILABLE` while the
/// coordinator is down, `UNAUTHENTICATED` with a wrong token.
///
/// # Errors
/// [`ConnectError`] for a malformed address.
pub fn coordinator_client(
    addr: &str,
    security: &ClientSecurity,
) -> Result<CoordinatorClient<AuthChannel>, ConnectError> {
    let addr = &coordinator_address(addr);
    let endpoint = security
        .endpoint(addr)
        .map_err(|e| ConnectError {
            addr: addr.to_string(),
            reason: e.reason,
        })?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(16 << 20))
        .initial_connection_window_size(Some(32 << 20));
    Ok(
        CoordinatorClient::new(security.wrap(endpoint.connect_lazy()))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
    )
}

#[cfg(test)]
mod tests {
    use super::coordinator_address;

    #[test]
    fn a_host_without_a_port_gets_the_coordinator_default() {
        assert_eq!(coordinator_address("127.0.0.1"), "127.0.0.1:7070");
        assert_eq!(coordinator_address("node-1"), "node-1:7070");
        assert_eq!(coordinator_address("http://node-1"), "http://node-1:7070");
        assert_eq!(coordinator_address("[::1]"), "[::1]:7070");
        assert_eq!(coordinator_address("::1"), "[::1]:7070");
        for given in [
            "127.0.0.1:9000",
            "node-1:7071",
            "[::1]:9000",
            "https://n:443",
        ] {
            assert_eq!(coordinator_address(given), given);
        }
    }
}
