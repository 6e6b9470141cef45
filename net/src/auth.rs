//! The cluster token: the one shared secret every Keel process proves on every call.
//!
//! Every RPC (client to coordinator, worker to coordinator, worker to worker on the ring)
//! carries the metadata `authorization: Bearer <token>`; servers compare it with their own
//! token in constant time. The first call with the token marks its connection proven
//! ([`crate::slots`]): only proven connections are safe from eviction when strangers fill the
//! server. Servers answer `UNAUTHENTICATED` to anything else,
//! logging the refusal (RPC path, remote address) and doing nothing. At most one refusal per
//! reason is logged per [`REFUSAL_LOG_INTERVAL`], with the count of those left out.
//!
//! # What stays open
//! The gRPC health service (`grpc.health.v1.Health`) answers without a token: Kubernetes'
//! `grpc:` probes cannot send metadata, and health reveals nothing (SERVING or not) and does
//! nothing. Reflection and every Keel service need the token.
//!
//! # Layout
//! - [`ClusterToken`]: the secret, loaded from a file ([`ClusterToken::load`]) or made fresh
//!   ([`ClusterToken::create_file`], for `keel local`).
//! - [`RequireToken`]: server side, a service wrapper that refuses calls without the token.
//! - [`BearerToken`]: client side, an interceptor that adds the token to every call;
//!   [`AuthChannel`] is a channel with it.
//! - [`TokenArgs`]: the `--token-file` flag (`KEEL_TOKEN_FILE`) every binary takes.

use std::convert::Infallible;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use subtle::ConstantTimeEq;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::server::NamedService;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};

use crate::connection::ConnInfo;
use crate::ratelimit::LogLimit;

/// Shortest accepted token, bytes after trimming surrounding whitespace.
pub const MIN_TOKEN_BYTES: usize = 16;

/// How to make a token file, quoted by every error about a missing or bad one.
pub const TOKEN_HOWTO: &str =
    "make one with: head -c 32 /dev/urandom | base64 > keel.token; chmod 600 keel.token";

/// The metadata key the token travels in (HTTP's `Authorization` header).
const AUTHORIZATION: &str = "authorization";

/// Errors loading or making a cluster token. Each names the file and says how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No token file was given.
    #[error("no cluster token: pass --token-file FILE or set KEEL_TOKEN_FILE ({TOKEN_HOWTO})")]
    NotGiven,
    /// The file cannot be read (missing, no permission). The message says how to make one
    /// only when the file is missing, and what to check when this user may not read it.
    #[error("cluster token file {path}: {source}{}", read_hint(.path, .source))]
    Io {
        /// The token file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A fresh token file cannot be written ([`ClusterToken::create_file`]: it exists already,
    /// or its folder is not writable).
    #[error("cluster token file {path}: cannot create it: {source}")]
    Create {
        /// The token file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file holds only whitespace.
    #[error("cluster token file {path} is empty ({TOKEN_HOWTO})")]
    Empty {
        /// The token file.
        path: PathBuf,
    },
    /// The token is shorter than [`MIN_TOKEN_BYTES`].
    #[error(
        "cluster token file {path}: the token is {len} bytes, at least {MIN_TOKEN_BYTES} are required ({TOKEN_HOWTO})"
    )]
    TooShort {
        /// The token file.
        path: PathBuf,
        /// Its length after trimming, bytes.
        len: usize,
    },
    /// The token has bytes an HTTP header cannot carry (outside printable ASCII, or spaces).
    #[error(
        "cluster token file {path}: the token must be printable ASCII without spaces (byte {offset} is not) ({TOKEN_HOWTO})"
    )]
    NotPrintable {
        /// The token file.
        path: PathBuf,
        /// Offset of the first bad byte in the trimmed token.
        offset: usize,
    },
}

/// What to do about an error reading the token file at `path`: make one when it is missing;
/// when this user may not read it, check the file's owner and mode (or, when even its
/// metadata is out of reach, the folders above it); nothing to add otherwise.
fn read_hint(path: &Path, source: &std::io::Error) -> String {
    match source.kind() {
        std::io::ErrorKind::NotFound => format!(" ({TOKEN_HOWTO})"),
        std::io::ErrorKind::PermissionDenied if std::fs::metadata(path).is_ok() => format!(
            " (the file exists, but {} may not read it: check its owner and mode with ls -l {})",
            this_user(),
            path.display()
        ),
        std::io::ErrorKind::PermissionDenied => format!(
            " ({} may not reach it: check the owner and mode of the folders above it)",
            this_user()
        ),
        _ => String::new(),
    }
}

/// "this user (uid N)", N the effective uid file permissions are checked against.
fn this_user() -> String {
    #[cfg(unix)]
    {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let uid = unsafe { libc::geteuid() };
        format!("this user (uid {uid})")
    }
    #[cfg(not(unix))]
    {
        "this user".to_string()
    }
}

/// The cluster's shared secret. Cheap to clone; `Debug` never prints it.
#[derive(Clone)]
pub struct ClusterToken {
    /// The token's bytes (printable ASCII, at least [`MIN_TOKEN_BYTES`]).
    secret: Arc<str>,
}

impl fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterToken(<redacted>)")
    }
}

impl ClusterToken {
    /// Reads the token from `path`: its contents with surrounding whitespace trimmed (so
    /// `base64 > file` with its newline works). Logs a warning when the file is readable by
    /// its group or others (it should be `chmod 600`).
    ///
    /// Errors: [`AuthError::Io`] (missing, unreadable), [`AuthError::Empty`],
    /// [`AuthError::TooShort`], [`AuthError::NotPrintable`], each naming the file.
    pub fn load(path: &Path) -> Result<ClusterToken, AuthError> {
        let io = |source| AuthError::Io {
            path: path.to_path_buf(),
            source,
        };
        let bytes = std::fs::read(path).map_err(io)?;
        warn_if_exposed(path);
        let token = bytes.trim_ascii();
        if token.is_empty() {
            return Err(AuthError::Empty {
                path: path.to_path_buf(),
            });
        }
        if token.len() < MIN_TOKEN_BYTES {
            return Err(AuthError::TooShort {
                path: path.to_path_buf(),
                len: token.len(),
            });
        }
        if let Some(offset) = token.iter().position(|b| !b.is_ascii_graphic()) {
            return Err(AuthError::NotPrintable {
                path: path.to_path_buf(),
                offset,
            });
        }
        // Printable ASCII checked above: valid UTF-8.
        let secret = String::from_utf8_lossy(token);
        Ok(ClusterToken {
            secret: Arc::from(secret.as_ref()),
        })
    }

    /// Makes a fresh random token (32 random bytes as 64 hex digits) and writes it to `path`,
    /// which must not exist yet, readable by its owner only (mode 600). For `keel local`'s
    /// throwaway cluster.
    ///
    /// Errors: [`AuthError::Create`] if the file exists or cannot be written.
    pub fn create_file(path: &Path) -> Result<ClusterToken, AuthError> {
        use std::io::Write;
        // ThreadRng: a CSPRNG seeded from the operating system.
        let bytes: [u8; 32] = rand::random();
        let secret = keel_proto::checkpoint::hex(&bytes);
        let io = |source| AuthError::Create {
            path: path.to_path_buf(),
            source,
        };
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(path).map_err(io)?;
        file.write_all(secret.as_bytes()).map_err(io)?;
        file.write_all(b"\n").map_err(io)?;
        file.sync_all().map_err(io)?;
        Ok(ClusterToken {
            secret: Arc::from(secret.as_str()),
        })
    }

    /// Whether `presented` is this token; constant time in the token's contents.
    pub fn matches(&self, presented: &[u8]) -> bool {
        self.secret.as_bytes().ct_eq(presented).into()
    }

    /// A server-side wrapper refusing calls to `inner` that lack this token.
    pub fn require<S>(&self, inner: S) -> RequireToken<S> {
        RequireToken {
            inner,
            token: self.clone(),
        }
    }

    /// The client-side interceptor adding this token to every call.
    pub fn bearer(&self) -> BearerToken {
        let value: Option<AsciiMetadataValue> = format!("Bearer {}", self.secret).parse().ok();
        BearerToken {
            // Printable ASCII is always a valid metadata value; never index it in HPACK tables.
            value: value.map(|mut v| {
                v.set_sensitive(true);
                v
            }),
        }
    }
}

/// Warns (does not fail) when the token file is readable by its group or others.
fn warn_if_exposed(path: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::metadata(path) {
            let mode = meta.permissions().mode();
            if mode & 0o077 != 0 {
                tracing::warn!(
                    "cluster token file {} is readable by others (mode {:o}): chmod 600 {}",
                    path.display(),
                    mode & 0o777,
                    path.display()
                );
            }
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}

/// The `--token-file` flag every Keel binary takes.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TokenArgs {
    /// File holding the cluster token (required; every process of a cluster uses the same one).
    #[arg(long, env = "KEEL_TOKEN_FILE", value_name = "FILE")]
    pub token_file: Option<PathBuf>,
}

impl TokenArgs {
    /// Loads the token the flag names.
    ///
    /// Errors: [`AuthError::NotGiven`] without the flag, else those of [`ClusterToken::load`].
    pub fn load(&self) -> Result<ClusterToken, AuthError> {
        match &self.token_file {
            Some(path) => ClusterToken::load(path),
            None => Err(AuthError::NotGiven),
        }
    }
}

/// A service that runs `inner` only for calls carrying the cluster token; others get
/// `UNAUTHENTICATED` and a warning in the log (RPC path, remote address). Keeps the inner
/// service's gRPC name, so it is added to a tonic server like the service itself.
#[derive(Clone, Debug)]
pub struct RequireToken<S> {
    /// The protected service.
    inner: S,
    /// The token calls must carry.
    token: ClusterToken,
}

impl<S: NamedService> NamedService for RequireToken<S> {
    const NAME: &'static str = S::NAME;
}

/// Shortest time between two logged refusals for the same reason: a stranger can make calls
/// as fast as the network allows, and a warning per call would fill the disk.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The limiter for refusals for `reason` (one per reason, so a flood of one kind does not
/// hide the first of another).
fn refusal_log(reason: &str) -> &'static LogLimit {
    static LIMITS: [LogLimit; 3] = [
        LogLimit::new(REFUSAL_LOG_INTERVAL),
        LogLimit::new(REFUSAL_LOG_INTERVAL),
        LogLimit::new(REFUSAL_LOG_INTERVAL),
    ];
    match reason {
        NO_TOKEN => &LIMITS[0],
        WRONG_TOKEN => &LIMITS[1],
        _ => &LIMITS[2],
    }
}

/// [`refusal`]'s reasons.
const NO_TOKEN: &str = "no cluster token";
const WRONG_TOKEN: &str = "wrong cluster token";

/// Why a call was refused, for the log and the status message.
fn refusal(headers: &http::HeaderMap, token: &ClusterToken) -> Option<&'static str> {
    let Some(value) = headers.get(AUTHORIZATION) else {
        return Some(NO_TOKEN);
    };
    let presented = value.as_bytes().strip_prefix(b"Bearer ");
    match presented {
        Some(t) if token.matches(t) => None,
        Some(_) => Some(WRONG_TOKEN),
        None => Some("authorization is not 'Bearer <token>'"),
    }
}

/// The connection a call came on, when it was accepted by [`crate::incoming::Incoming`]. Under
/// TLS tonic adds the connection's own info beside its `TlsConnectInfo`, so this finds it too
/// (tested in `tests/proof.rs`).
fn conn_info<B>(req: &http::Request<B>) -> Option<&ConnInfo> {
    req.extensions().get::<ConnInfo>()
}

/// The caller's address, when the transport recorded it.
fn remote_addr<B>(req: &http::Request<B>) -> Option<std::net::SocketAddr> {
    conn_info(req).and_then(ConnInfo::remote_addr)
}

impl<S, B> Service<http::Request<B>> for RequireToken<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<http::Response<Body>, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        match refusal(req.headers(), &self.token) {
            None => {
                // The caller holds the token: its connection may keep its slot.
                if let Some(info) = conn_info(&req) {
                    info.prove();
                }
                Box::pin(self.inner.call(req))
            }
            Some(reason) => {
                let remote =
                    remote_addr(&req).map_or_else(|| "unknown".to_string(), |a| a.to_string());
                if let Some(suppressed) = refusal_log(reason).check() {
                    // `suppressed`: refusals for this reason not logged since the last line.
                    tracing::warn!(
                        path = %req.uri().path(),
                        remote = %remote,
                        suppressed,
                        "refused: {reason}"
                    );
                }
                let status = Status::unauthenticated(format!(
                    "{reason} (every call to this Keel cluster needs its token)"
                ));
                let response = status.into_http::<()>().map(|()| Body::empty());
                Box::pin(async move { Ok(response) })
            }
        }
    }
}

/// Client-side interceptor adding `authorization: Bearer <token>` to every call.
#[derive(Clone, Debug)]
pub struct BearerToken {
    /// The header value; `None` sends no token (only for in-process tests and benchmarks
    /// against servers without [`RequireToken`]).
    value: Option<AsciiMetadataValue>,
}

impl BearerToken {
    /// An interceptor that adds nothing: for talking to servers that ask no token (in-process
    /// tests, `keel-worker bench-allreduce`). Real clusters always use [`ClusterToken::bearer`].
    pub fn none() -> BearerToken {
        BearerToken { value: None }
    }
}

impl Interceptor for BearerToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.value {
            let value: MetadataValue<_> = value.clone();
            request.metadata_mut().insert(AUTHORIZATION, value);
        }
        Ok(request)
    }
}

/// A channel whose every call carries the cluster token.
pub type AuthChannel = InterceptedService<Channel, BearerToken>;

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn load_trims_and_checks_the_token() {
        let dir = tempfile::tempdir().unwrap();
        let ok = write(dir.path(), "ok", "  0123456789abcdef0123\n");
        let token = ClusterToken::load(&ok).unwrap();
        assert!(token.matches(b"0123456789abcdef0123"));
        assert!(!token.matches(b"0123456789abcdef0124"));
        assert!(!token.matches(b"0123456789abcdef012"));
        assert!(!format!("{token:?}").contains("0123"));

        let missing = dir.path().join("missing");
        let e = ClusterToken::load(&missing).unwrap_err();
        assert!(matches!(e, AuthError::Io { .. }), "{e}");
        assert!(e.to_string().contains("missing") && e.to_string().contains("head -c 32"));

        let e = ClusterToken::load(&write(dir.path(), "empty", " \n\n")).unwrap_err();
        assert!(matches!(e, AuthError::Empty { .. }), "{e}");
        assert!(e.to_string().contains("empty"), "{e}");

        let e = ClusterToken::load(&write(dir.path(), "short", "0123456789abcde\n")).unwrap_err();
        assert!(matches!(e, AuthError::TooShort { len: 15, .. }), "{e}");
        assert!(e.to_string().contains("short"), "{e}");

        let e =
            ClusterToken::load(&write(dir.path(), "space", "0123456789 abcdef0123")).unwrap_err();
        assert!(
            matches!(e, AuthError::NotPrintable { offset: 10, .. }),
            "{e}"
        );

        assert!(matches!(
            TokenArgs::default().load(),
            Err(AuthError::NotGiven)
        ));
    }

    /// A missing file gets the recipe for a new token; a file this user may not read gets
    /// what to check instead (a new token would not help: the cluster already has one).
    #[test]
    fn unreadable_and_missing_token_files_say_different_things() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.token");
        let missing = AuthError::Io {
            path: path.clone(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        }
        .to_string();
        assert!(missing.contains("make one with: head -c 32"), "{missing}");
        assert!(!missing.contains("owner and mode"), "{missing}");

        // The file exists (its metadata can be read): its own owner and mode are the problem.
        write(dir.path(), "keel.token", "0123456789abcdef0123\n");
        let denied = AuthError::Io {
            path: path.clone(),
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        }
        .to_string();
        assert!(!denied.contains("head -c 32"), "{denied}");
        assert!(
            denied.contains("the file exists, but this user")
                && denied.contains("may not read it: check its owner and mode")
                && denied.contains(&format!("ls -l {}", path.display())),
            "{denied}"
        );
        #[cfg(unix)]
        assert!(
            denied.contains(&format!("(uid {})", unsafe { libc::geteuid() })),
            "{denied}"
        );

        // Not even its metadata: a folder above it is in the way.
        let hidden = AuthError::Io {
            path: dir.path().join("missing").join("keel.token"),
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        }
        .to_string();
        assert!(
            !hidden.contains("head -c 32") && hidden.contains("folders above it"),
            "{hidden}"
        );

        // For real, where the test runs unprivileged (root reads any file).
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o000)).unwrap();
            if std::fs::read(&path).is_err() {
                let e = ClusterToken::load(&path).unwrap_err().to_string();
                assert!(
                    e.contains("the file exists") && !e.contains("head -c 32"),
                    "{e}"
                );
            }
        }

        // Making a token where one exists says so, without the recipe.
        let e = ClusterToken::create_file(&path).unwrap_err();
        assert!(matches!(e, AuthError::Create { .. }), "{e}");
        assert!(e.to_string().contains("cannot create it"), "{e}");
    }

    #[test]
    fn created_tokens_are_private_random_and_load_back() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let ta = ClusterToken::create_file(&a).unwrap();
        let tb = ClusterToken::create_file(&b).unwrap();
        assert!(!ta.matches(tb.secret.as_bytes()));
        assert!(
            ClusterToken::load(&a)
                .unwrap()
                .matches(ta.secret.as_bytes())
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&a).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert!(
            ClusterToken::create_file(&a).is_err(),
            "an existing file is not overwritten"
        );
    }

    #[test]
    fn refusal_names_missing_wrong_and_malformed_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let token = ClusterToken::load(&write(dir.path(), "t", "0123456789abcdef")).unwrap();
        let mut headers = http::HeaderMap::new();
        assert_eq!(refusal(&headers, &token), Some("no cluster token"));
        headers.insert(AUTHORIZATION, "Bearer 0123456789abcdeX".parse().unwrap());
        assert_eq!(refusal(&headers, &token), Some("wrong cluster token"));
        headers.insert(AUTHORIZATION, "0123456789abcdef".parse().unwrap());
        assert!(refusal(&headers, &token).is_some());
        headers.insert(AUTHORIZATION, "Bearer 0123456789abcdef".parse().unwrap());
        assert_eq!(refusal(&headers, &token), None);
        // What the client interceptor sends is what the server accepts.
        let mut request = Request::new(());
        request = token.bearer().call(request).unwrap();
        let sent = request.metadata().get(AUTHORIZATION).unwrap().as_bytes();
        let mut headers = http::HeaderMap::new();
        headers.insert(AUTHORIZATION, http::HeaderValue::from_bytes(sent).unwrap());
        assert_eq!(refusal(&headers, &token), None);
    }
}
