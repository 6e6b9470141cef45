//! How a Keel process serves and calls: the cluster token ([`crate::auth`]) plus optional TLS
//! ([`crate::tls`]), bundled for the two sides.
//!
//! # Layout
//! - [`ServerSecurity`]: builds a tonic server (TLS when configured, keepalive pings) and wraps
//!   services so that they need the token. Health is added unwrapped: it stays open (see
//!   [`crate::auth`]). Its [`ServerSecurity::incoming`] accepts connections within the
//!   server's [`ConnectionLimits`] (see [`crate::incoming`]).
//! - [`ClientSecurity`]: builds endpoints (`https` when a CA is given) and channels that send
//!   the token.

use tonic::transport::{Channel, ClientTlsConfig, Endpoint, Server, ServerTlsConfig};

use crate::auth::{AuthChannel, AuthError, BearerToken, ClusterToken, RequireToken, TokenArgs};
use crate::incoming::{ConnectionLimits, Incoming, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT};
use crate::tls::{ClientTlsArgs, ServerTlsArgs, TlsError};

/// Errors setting up a process's security from its flags.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    /// The token file is missing or bad.
    #[error(transparent)]
    Auth(#[from] AuthError),
    /// A TLS file is missing or bad.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A worker got only one side of TLS.
    #[error(
        "a worker both serves its ring peers and calls them: give --tls-cert, --tls-key and --tls-ca together, or none"
    )]
    OneSidedTls,
}

/// A worker's security from its flags: it serves (ring) and calls (coordinator, ring peers),
/// so TLS is all (`--tls-cert`, `--tls-key`, `--tls-ca`) or nothing.
///
/// Errors: [`SecurityError::Auth`] (no or bad token file), [`SecurityError::Tls`],
/// [`SecurityError::OneSidedTls`].
pub fn worker_security(
    token: &TokenArgs,
    server_tls: &ServerTlsArgs,
    client_tls: &ClientTlsArgs,
) -> Result<(ServerSecurity, ClientSecurity), SecurityError> {
    let token = token.load()?;
    let server = server_tls.load()?;
    let client = client_tls.load()?;
    if server.is_some() != client.is_some() {
        return Err(SecurityError::OneSidedTls);
    }
    Ok((
        ServerSecurity::new(token.clone(), server),
        ClientSecurity::new(&token, client),
    ))
}

/// A malformed address or TLS setting for an endpoint.
#[derive(Debug, thiserror::Error)]
#[error("{addr}: {reason}")]
pub struct EndpointError {
    /// The address as given.
    pub addr: String,
    /// What is wrong with it.
    pub reason: String,
}

/// How this process calls other Keel processes: the token on every call; TLS (`https`,
/// trusting the given CA) when configured.
#[derive(Clone, Debug)]
pub struct ClientSecurity {
    /// Adds the token to every call.
    bearer: BearerToken,
    /// TLS settings; `None` is plaintext `http`.
    tls: Option<ClientTlsConfig>,
}

impl ClientSecurity {
    /// Calls carrying `token`, over TLS when `tls` is given.
    pub fn new(token: &ClusterToken, tls: Option<ClientTlsConfig>) -> ClientSecurity {
        ClientSecurity {
            bearer: token.bearer(),
            tls,
        }
    }

    /// Plaintext calls without a token: only for servers that ask none (in-process tests,
    /// `keel-worker bench-allreduce`'s loopback peers). Keel's binaries never use it.
    pub fn without_token() -> ClientSecurity {
        ClientSecurity {
            bearer: BearerToken::none(),
            tls: None,
        }
    }

    /// Whether calls use TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// An endpoint for `addr` (`host:port`; a leading `http://` or `https://` is replaced by
    /// the scheme the TLS setting gives), with TLS configured when it is set. Callers add
    /// their own timeouts and HTTP/2 settings.
    ///
    /// Errors: [`EndpointError`] for a malformed address.
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, EndpointError> {
        let bad = |reason: String| EndpointError {
            addr: addr.to_string(),
            reason,
        };
        let host_port = addr
            .strip_prefix("http://")
            .or_else(|| addr.strip_prefix("https://"))
            .unwrap_or(addr);
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let endpoint = Endpoint::from_shared(format!("{scheme}://{host_port}"))
            .map_err(|e| bad(e.to_string()))?;
        match &self.tls {
            Some(tls) => endpoint
                .tls_config(tls.clone())
                .map_err(|e| bad(format!("TLS: {e}"))),
            None => Ok(endpoint),
        }
    }

    /// `channel` with the token added to every call.
    pub fn wrap(&self, channel: Channel) -> AuthChannel {
        AuthChannel::new(channel, self.bearer.clone())
    }
}

/// How this process serves: every service but health needs the token; TLS when configured.
#[derive(Clone, Debug)]
pub struct ServerSecurity {
    /// The token calls must carry.
    token: ClusterToken,
    /// Certificate and key; `None` serves plaintext.
    tls: Option<ServerTlsConfig>,
    /// Bounds on accepted connections ([`ServerSecurity::incoming`]).
    limits: ConnectionLimits,
}

impl ServerSecurity {
    /// Serving that requires `token`, over TLS when `tls` is given.
    pub fn new(token: ClusterToken, tls: Option<ServerTlsConfig>) -> ServerSecurity {
        ServerSecurity {
            token,
            tls,
            limits: ConnectionLimits::default(),
        }
    }

    /// The same, accepting connections within `limits` instead of the defaults.
    pub fn with_connection_limits(self, limits: ConnectionLimits) -> ServerSecurity {
        ServerSecurity { limits, ..self }
    }

    /// The connections `listener` accepts, within this server's [`ConnectionLimits`], for
    /// `serve_with_incoming[_shutdown]` on [`ServerSecurity::server`]'s builder.
    pub fn incoming(&self, listener: tokio::net::TcpListener) -> Incoming {
        Incoming::new(listener, self.limits)
    }

    /// Whether the server speaks TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The token calls must carry (for the HTTP port's API, [`crate::http_port`]).
    pub fn token(&self) -> &ClusterToken {
        &self.token
    }

    /// The bounds on accepted connections.
    pub fn limits(&self) -> ConnectionLimits {
        self.limits
    }

    /// `service`, refusing calls without the token (`UNAUTHENTICATED`, logged).
    pub fn require<S>(&self, service: S) -> RequireToken<S> {
        self.token.require(service)
    }

    /// A tonic server builder, with TLS when configured (its handshake bounded by the
    /// handshake timeout), pinging every connection every [`KEEPALIVE_INTERVAL`] and closing
    /// those whose peer does not answer within [`KEEPALIVE_TIMEOUT`].
    ///
    /// Errors: tonic's, when the certificate or key does not parse.
    pub fn server(&self) -> Result<Server, tonic::transport::Error> {
        let server = Server::builder()
            .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT));
        match &self.tls {
            Some(tls) => server.tls_config(tls.clone().timeout(self.limits.handshake_timeout)),
            None => Ok(server),
        }
    }
}
