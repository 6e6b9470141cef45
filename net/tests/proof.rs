//! A connection proves itself with its first call carrying the token, over plaintext and TLS
//! (tonic then hands the token check the connection's info wrapped in its TLS info): a
//! token-holder's long call outlives the auth timeout, a stranger's call on an open service
//! (health) is cut at it, and strangers filling the server do not keep a token-holder out.

use keel_net::auth::ClusterToken;
use keel_net::incoming::ConnectionLimits;
use keel_net::security::{ClientSecurity, ServerSecurity};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio_stream::StreamExt;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::server::health_reporter;

/// The auth timeout of the servers here.
const AUTH_TIMEOUT: Duration = Duration::from_millis(800);

struct Setup {
    token: ClusterToken,
    server_tls: Option<ServerTlsConfig>,
    client_tls: Option<ClientTlsConfig>,
    _dir: tempfile::TempDir,
}

fn setup(tls: bool) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let token = ClusterToken::create_file(&dir.path().join("keel.token")).unwrap();
    let (server_tls, client_tls) = if tls {
        let key = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let identity = Identity::from_pem(key.cert.pem(), key.signing_key.serialize_pem());
        let ca = Certificate::from_pem(key.cert.pem());
        (
            Some(ServerTlsConfig::new().identity(identity)),
            Some(
                ClientTlsConfig::new()
                    .ca_certificate(ca)
                    .domain_name("localhost"),
            ),
        )
    } else {
        (None, None)
    };
    Setup {
        token,
        server_tls,
        client_tls,
        _dir: dir,
    }
}

/// Two servers on 127.0.0.1 with the health service: open (as every Keel server has it) and
/// behind the token (as every Keel service is). Returns their addresses (open, guarded).
async fn serve(s: &Setup, max_connections: usize) -> (String, String) {
    let limits = ConnectionLimits {
        max_connections,
        max_unauthenticated: max_connections,
        auth_timeout: AUTH_TIMEOUT,
        ..ConnectionLimits::default()
    };
    let security =
        ServerSecurity::new(s.token.clone(), s.server_tls.clone()).with_connection_limits(limits);
    let mut addrs = Vec::new();
    for guarded in [false, true] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(listener.local_addr().unwrap().to_string());
        let (reporter, health) = health_reporter();
        reporter
            .set_service_status("", tonic_health::ServingStatus::Serving)
            .await;
        let incoming = security.incoming(listener);
        let mut server = security.server().unwrap();
        let router = if guarded {
            server.add_service(security.require(health))
        } else {
            server.add_service(health)
        };
        tokio::spawn(async move {
            // Keep the reporter (the watch streams end without it).
            let _reporter = reporter;
            router.serve_with_incoming(incoming).await
        });
    }
    (addrs.remove(0), addrs.remove(0))
}

async fn client(
    s: &Setup,
    addr: &str,
    with_token: bool,
) -> HealthClient<keel_net::auth::AuthChannel> {
    let security = if with_token {
        ClientSecurity::new(&s.token, s.client_tls.clone())
    } else {
        let other = tempfile::tempdir().unwrap();
        let stranger = ClusterToken::create_file(&other.path().join("t")).unwrap();
        ClientSecurity::new(&stranger, s.client_tls.clone())
    };
    let channel = security.endpoint(addr).unwrap().connect().await.unwrap();
    HealthClient::new(security.wrap(channel))
}

/// Whether a `Watch` stream is still open (no error, no end) `wait` after its first message.
async fn watch_survives(
    mut client: HealthClient<keel_net::auth::AuthChannel>,
    wait: Duration,
) -> bool {
    let mut stream = client
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(stream.next().await.unwrap().is_ok());
    tokio::time::timeout(wait, stream.next()).await.is_err()
}

async fn token_holders_stay_and_strangers_calls_are_cut(tls: bool) {
    let s = setup(tls);
    let (open, guarded) = serve(&s, 64).await;
    // With the token: the call proves the connection; it outlives the auth timeout.
    let proven = client(&s, &guarded, true).await;
    assert!(
        watch_survives(proven, AUTH_TIMEOUT * 4).await,
        "tls {tls}: a proven connection was closed"
    );
    // Health without a token: open, but it proves nothing; the connection is closed at the
    // auth timeout.
    let stranger = client(&s, &open, false).await;
    assert!(
        !watch_survives(stranger, AUTH_TIMEOUT * 4).await,
        "tls {tls}: a connection without the token outlived the auth timeout"
    );
}

#[tokio::test]
async fn plaintext_token_holders_stay_and_strangers_calls_are_cut() {
    token_holders_stay_and_strangers_calls_are_cut(false).await;
}

#[tokio::test]
async fn tls_token_holders_stay_and_strangers_calls_are_cut() {
    token_holders_stay_and_strangers_calls_are_cut(true).await;
}

#[tokio::test]
async fn over_tls_strangers_filling_the_server_do_not_keep_the_token_out() {
    let s = setup(true);
    let (_, guarded) = serve(&s, 16).await;
    // 64 strangers (4 times the cap) that start a TLS handshake and stall.
    let mut strangers = Vec::new();
    for _ in 0..64 {
        let mut c = tokio::net::TcpStream::connect(&guarded).await.unwrap();
        // A TLS record header of a ClientHello, then nothing.
        c.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).await.unwrap();
        strangers.push(c);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut proven = client(&s, &guarded, true).await;
    let reply = tokio::time::timeout(
        Duration::from_secs(5),
        proven.check(HealthCheckRequest {
            service: String::new(),
        }),
    )
    .await;
    assert!(matches!(reply, Ok(Ok(_))), "{reply:?}");
}

#[tokio::test]
async fn strangers_on_one_address_evict_only_their_own_connections() {
    let s = setup(false);
    let (_, guarded) = serve(&s, 16).await;
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    // A connection from 127.0.0.2 (loopback too) that has made no call yet: the oldest.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut other = socket.connect(guarded.parse().unwrap()).await.unwrap();
    other.write_all(preface).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // 100 strangers from 127.0.0.1, six times the cap.
    let mut strangers = Vec::new();
    for _ in 0..100 {
        let mut c = tokio::net::TcpStream::connect(&guarded).await.unwrap();
        c.write_all(preface).await.unwrap();
        strangers.push(c);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The strangers' first connections were evicted; the other address's one was not.
    let closed = |c: &mut tokio::net::TcpStream| {
        let mut buf = [0u8; 256];
        // Drain what the server sent (its SETTINGS): an EOF or an error means closed.
        for _ in 0..16 {
            match c.try_read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
        false
    };
    assert!(
        closed(&mut strangers[0]),
        "the oldest stranger was not evicted"
    );
    assert!(
        !closed(&mut other),
        "a connection from another address was evicted"
    );
}
