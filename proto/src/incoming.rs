//! The accepted side of a server's TCP connections.
//!
//! tonic applies its `tcp_nodelay` setting only to listeners it binds itself; with
//! `serve_with_incoming` (which Keel uses, to bind first and log the real port) accepted sockets
//! keep Nagle's algorithm. The ring's acks and the control plane's small replies then wait for
//! the peer's delayed ACK: measured, 4 MiB all-reduces took ~45 ms instead of ~13 ms.

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

/// The connections `listener` accepts, each with `TCP_NODELAY` set, for
/// `Server::serve_with_incoming[_shutdown]`. Accept errors go to tonic, which goes on accepting
/// (as with tokio's `TcpListenerStream`, which Keel used before).
pub fn nodelay_incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    /// The regression: accepted sockets had Nagle on (tonic ignores `tcp_nodelay` with
    /// `serve_with_incoming`), which delayed ring acks by the peer's delayed ACK.
    #[tokio::test]
    async fn accepted_connections_have_nodelay() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = nodelay_incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(accepted.nodelay().unwrap());
    }
}
