//! One stream of a ring link: a long-lived bidirectional `Ring/Stream` call to the right
//! neighbour, run by a background task. Frames go out in order; the receiver acknowledges each
//! in order, so the n-th ack answers the n-th frame. Streaming avoids a request's headers,
//! task spawn and status per frame (measured: unary calls cost far more CPU per frame).
//!
//! When the call fails (connection lost), every frame awaiting its ack fails with the call's
//! status and the next frame opens a new call (the channel reconnects).

use std::collections::VecDeque;
use std::convert::Infallible;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::StreamBody;
use keel_net::auth::AuthChannel;
use keel_proto::ring_rpc::{PushAck, RingFrame};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::body::Body;
use tonic::codec::{BufferSettings, Streaming};
use tonic::codegen::{Service, http};
use tonic::{Code, Status};
use tonic_prost::ProstDecoder;

use super::wire::MAX_MESSAGE_BYTES;
use super::wire::{STREAM_PATH, encode_frame};

/// Result of pushing one frame: accepted, or the receiver's (or transport's) status.
type Ack = Result<(), Status>;

/// A frame and where to report its ack.
struct Outbound {
    frame: RingFrame,
    done: oneshot::Sender<Ack>,
}

/// Handle to one stream of a ring link; dropping it ends the background task and the call.
pub(crate) struct LinkStream {
    /// To the background task.
    tx: mpsc::UnboundedSender<Outbound>,
}

impl LinkStream {
    /// Starts the background task for `client` (one connection, with the cluster token). Needs
    /// a tokio runtime.
    pub(crate) fn spawn(client: AuthChannel) -> LinkStream {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(client, rx));
        LinkStream { tx }
    }

    /// Sends one frame and waits for the receiver's ack.
    ///
    /// Errors: the receiver's refusal as a [`Status`] (its code), or `UNAVAILABLE` when the
    /// call failed or the task is gone.
    pub(crate) async fn push(&self, frame: RingFrame) -> Ack {
        let (done, ack) = oneshot::channel();
        self.tx
            .send(Outbound { frame, done })
            .map_err(|_| Status::unavailable("ring link task stopped"))?;
        ack.await
            .unwrap_or_else(|_| Err(Status::unavailable("ring link dropped the frame")))
    }
}

fn ack_to_result(ack: PushAck) -> Ack {
    if ack.code == 0 {
        Ok(())
    } else {
        Err(Status::new(Code::from_i32(ack.code as i32), ack.message))
    }
}

/// Opens one `Ring/Stream` call on `client` whose request body starts with `first` and goes on
/// with the byte pieces sent on the returned sender (see `wire::encode_frame`), and returns the
/// call's acks. `first` is queued before the call starts, so HTTP/2 sends it right behind the
/// request headers instead of a round trip later.
///
/// Errors: the frame's encoding, the transport's failure, or the status of a call refused at
/// once (e.g. `UNAUTHENTICATED`).
async fn open_call(
    client: &mut AuthChannel,
    first: &RingFrame,
) -> Result<(mpsc::UnboundedSender<Bytes>, Streaming<PushAck>), Status> {
    let (pieces_tx, pieces_rx) = mpsc::unbounded_channel::<Bytes>();
    send_frame(&pieces_tx, first)?;
    let pieces = UnboundedReceiverStream::new(pieces_rx)
        .map(|piece| Ok::<_, Infallible>(http_body::Frame::data(piece)));
    let mut request = http::Request::new(Body::new(StreamBody::new(pieces)));
    *request.method_mut() = http::Method::POST;
    *request.uri_mut() = http::Uri::from_static(STREAM_PATH);
    let headers = request.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    headers.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    futures::future::poll_fn(|cx| client.poll_ready(cx))
        .await
        .map_err(|e| Status::unavailable(format!("ring connection: {e}")))?;
    let response = client
        .call(request)
        .await
        .map_err(|e| Status::from_error(Box::new(e)))?;
    let (parts, body) = response.into_parts();
    // A call refused before any message answers with its status in the headers.
    if let Some(status) = Status::from_header_map(&parts.headers)
        && status.code() != Code::Ok
    {
        return Err(status);
    }
    let acks = Streaming::new_response(
        ProstDecoder::<PushAck>::new(BufferSettings::default()),
        body,
        parts.status,
        None,
        Some(MAX_MESSAGE_BYTES),
    );
    Ok((pieces_tx, acks))
}

/// Queues `frame` on a call's request body.
///
/// Errors: `UNAVAILABLE` when the call's body is gone (the call ended).
fn send_frame(pieces: &mpsc::UnboundedSender<Bytes>, frame: &RingFrame) -> Result<(), Status> {
    for piece in encode_frame(frame)? {
        crate::telemetry::add_ring_bytes(piece.len());
        pieces
            .send(piece)
            .map_err(|_| Status::unavailable("ring stream closed"))?;
    }
    Ok(())
}

/// The background task: one call at a time, re-opened after a failure when a frame comes.
async fn run(mut client: AuthChannel, mut rx: mpsc::UnboundedReceiver<Outbound>) {
    let mut next: Option<Outbound> = None;
    loop {
        let first = match next.take() {
            Some(o) => o,
            None => match rx.recv().await {
                Some(o) => o,
                None => return,
            },
        };
        let mut pending: VecDeque<oneshot::Sender<Ack>> = VecDeque::new();
        let Outbound { frame, done } = first;
        let opened = open_call(&mut client, &frame).await;
        // The call's body holds its own copy of the payload; keeping this one for the call's
        // life would keep the sender's whole buffer alive (see `shared_buf`).
        drop(frame);
        let (pieces, mut acks) = match opened {
            Ok(call) => call,
            Err(status) => {
                let _ = done.send(Err(status));
                continue;
            }
        };
        pending.push_back(done);
        loop {
            tokio::select! {
                out = rx.recv() => match out {
                    Some(o) => match send_frame(&pieces, &o.frame) {
                        Ok(()) => pending.push_back(o.done),
                        Err(status) => {
                            let _ = o.done.send(Err(status));
                        }
                    },
                    // The ring was dropped: nobody waits for acks any more.
                    None => return,
                },
                ack = acks.message() => match ack {
                    Ok(Some(ack)) => {
                        if let Some(done) = pending.pop_front() {
                            let _ = done.send(ack_to_result(ack));
                        }
                    }
                    Ok(None) => {
                        fail_all(&mut pending, &Status::unavailable("ring stream ended by the peer"));
                        break;
                    }
                    Err(status) => {
                        fail_all(&mut pending, &status);
                        break;
                    }
                },
            }
        }
    }
}

fn fail_all(pending: &mut VecDeque<oneshot::Sender<Ack>>, status: &Status) {
    for done in pending.drain(..) {
        let _ = done.send(Err(Status::new(
            status.code(),
            status.message().to_string(),
        )));
    }
}
