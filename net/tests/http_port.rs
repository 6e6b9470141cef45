//! The HTTP port (`keel_net::http_port`) on real sockets: open routes answer anyone, the API
//! needs the cluster token off loopback, and with `--tls-cert`/`--tls-key` the port speaks
//! HTTPS with that certificate (a plain-HTTP request gets no HTTP answer).

use axum::Router;
use axum::routing::get;
use keel_net::auth::ClusterToken;
use keel_net::http_port::{Routes, serve};
use keel_net::incoming::ConnectionLimits;
use keel_net::tls::ServerTlsArgs;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

fn routes() -> Routes {
    Routes {
        open: Router::new().route("/healthz", get(|| async { "ok" })),
        protected: Router::new().route("/api/secret", get(|| async { "the data" })),
    }
}

/// Starts the port on `bind` (port 0) on a runtime of its own; returns the port.
fn start(bind: &str, token: ClusterToken, tls: Option<Arc<rustls::ServerConfig>>) -> u16 {
    start_with(bind, token, tls, ConnectionLimits::default())
}

/// [`start`] with `limits`.
fn start_with(
    bind: &str,
    token: ClusterToken,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: ConnectionLimits,
) -> u16 {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(bind))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        runtime.block_on(serve(
            listener,
            token,
            limits,
            tls,
            routes(),
            std::future::pending(),
        ))
    });
    port
}

/// The status code and body of one request written on `stream`.
fn exchange(mut stream: impl Read + Write, path: &str, token: Option<&str>) -> (u16, String) {
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{auth}\r\n");
    // A server that refuses the bytes (a TLS port reading plain HTTP) may close the socket
    // while they are still being written: that is "no HTTP answer", code 0, not a test crash.
    if let Err(e) = stream.write_all(request.as_bytes()) {
        return (0, format!("write failed: {e}"));
    }
    let mut reply = Vec::new();
    // A TLS peer may end without close_notify; what arrived is what counts.
    let _ = stream.read_to_end(&mut reply);
    let reply = String::from_utf8_lossy(&reply).to_string();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    let code = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, body.to_string())
}

fn tcp(port: u16) -> std::net::TcpStream {
    let s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn token(dir: &std::path::Path) -> (ClusterToken, String) {
    let path = dir.join("keel.token");
    let token = ClusterToken::create_file(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap().trim().to_string();
    (token, text)
}

#[test]
fn off_loopback_the_api_needs_the_token_and_health_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let (token, secret) = token(dir.path());
    let port = start("0.0.0.0:0", token, None);
    assert_eq!(exchange(tcp(port), "/healthz", None), (200, "ok".into()));
    let (code, body) = exchange(tcp(port), "/api/secret", None);
    assert_eq!(code, 401);
    assert!(body.contains("no cluster token"), "{body}");
    assert_eq!(exchange(tcp(port), "/api/secret", Some("wrong")).0, 401);
    assert_eq!(
        exchange(tcp(port), "/api/secret", Some(&secret)),
        (200, "the data".into())
    );
}

#[test]
fn the_bearer_scheme_is_case_insensitive_and_spaces_do_not_matter() {
    let dir = tempfile::tempdir().unwrap();
    let (token, secret) = token(dir.path());
    let port = start("0.0.0.0:0", token, None);
    for header in [format!("bearer {secret}"), format!("BEARER  {secret} ")] {
        let mut stream = tcp(port);
        write!(
            stream,
            "GET /api/secret HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: {header}\r\n\r\n"
        )
        .unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).unwrap();
        assert!(reply.starts_with("HTTP/1.1 200"), "{header:?}: {reply}");
    }
    assert_eq!(exchange(tcp(port), "/api/secret", Some("")).0, 401);
}

#[test]
fn a_request_trickled_a_byte_at_a_time_is_cut_off() {
    // The deadline for a request's headers is the handshake timeout (default 10 s): a client
    // sending a header byte every second is closed then, not kept for ever.
    let dir = tempfile::tempdir().unwrap();
    let (token, _) = token(dir.path());
    let port = start("127.0.0.1:0", token, None);
    let mut stream = tcp(port);
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let started = std::time::Instant::now();
    let mut closed = false;
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(500));
        if stream.write_all(b"X").is_err() {
            closed = true;
            break;
        }
        stream
            .set_read_timeout(Some(Duration::from_millis(1)))
            .unwrap();
        let mut buf = [0u8; 512];
        match stream.read(&mut buf) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(_) => {
                // An error reply (408) before closing also ends it.
                closed = true;
                break;
            }
            Err(_) => {}
        }
    }
    let took = started.elapsed();
    assert!(closed, "still open after {took:?}");
    assert!(took < Duration::from_secs(15), "closed only after {took:?}");
}

#[test]
fn on_loopback_the_api_is_open() {
    let dir = tempfile::tempdir().unwrap();
    let (token, _) = token(dir.path());
    let port = start("127.0.0.1:0", token, None);
    assert_eq!(
        exchange(tcp(port), "/api/secret", None),
        (200, "the data".into())
    );
}

#[test]
fn with_a_certificate_the_port_speaks_https_only() {
    let dir = tempfile::tempdir().unwrap();
    let (token, secret) = token(dir.path());
    let key =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, key.cert.pem()).unwrap();
    std::fs::write(&key_path, key.signing_key.serialize_pem()).unwrap();
    let args = ServerTlsArgs {
        tls_cert: Some(cert_path),
        tls_key: Some(key_path.clone()),
    };
    let tls = args.load_http().unwrap();
    assert!(tls.is_some());
    let port = start("0.0.0.0:0", token, tls);

    let mut roots = rustls::RootCertStore::empty();
    roots.add(key.cert.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let client = Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    );
    let https = |path: &str, token: Option<&str>| {
        let name = "localhost".try_into().unwrap();
        let conn = rustls::ClientConnection::new(client.clone(), name).unwrap();
        let stream = rustls::StreamOwned::new(conn, tcp(port));
        exchange(stream, path, token)
    };
    assert_eq!(https("/healthz", None), (200, "ok".into()));
    assert_eq!(https("/api/secret", None).0, 401);
    assert_eq!(
        https("/api/secret", Some(&secret)),
        (200, "the data".into())
    );
    // Plain HTTP to the TLS port gets no HTTP answer.
    assert_eq!(exchange(tcp(port), "/healthz", None).0, 0);

    // A key file that is not a key is named.
    std::fs::write(
        &key_path,
        "-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    let err = args.load_http().unwrap_err().to_string();
    assert!(
        err.contains("--tls-key") && err.contains("key.pem"),
        "{err}"
    );
}

/// One keep-alive `GET /healthz` on `stream`; whether it was answered.
fn keep_alive_healthz(stream: &mut std::net::TcpStream) -> bool {
    if stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    for _ in 0..16 {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return false,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
        if got.ends_with(b"ok") {
            return true;
        }
    }
    false
}

#[test]
fn a_full_port_evicts_its_oldest_keep_alive_connection_for_a_new_client() {
    let dir = tempfile::tempdir().unwrap();
    let (token, _) = token(dir.path());
    let limits = ConnectionLimits {
        max_connections: 4,
        ..ConnectionLimits::default()
    };
    let port = start_with("127.0.0.1:0", token, None, limits);
    // Four keep-alive connections re-requesting /healthz hold the whole port.
    let mut held: Vec<std::net::TcpStream> = (0..4)
        .map(|_| {
            let mut s = tcp(port);
            assert!(keep_alive_healthz(&mut s));
            s
        })
        .collect();
    for s in &mut held {
        assert!(keep_alive_healthz(s));
    }
    // A new client gets its answer; the oldest held connection is closed for it.
    for round in 0..3 {
        assert_eq!(
            exchange(tcp(port), "/healthz", None),
            (200, "ok".into()),
            "round {round}"
        );
    }
    let mut buf = [0u8; 16];
    held[0]
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert!(
        matches!(held[0].read(&mut buf), Ok(0) | Err(_)),
        "the oldest keep-alive connection was not closed"
    );
    // Only as many as needed were evicted: the first newcomer's room was free again for the
    // next ones (they closed), so the other held connections still answer.
    for s in &mut held[1..] {
        assert!(keep_alive_healthz(s));
    }
}
