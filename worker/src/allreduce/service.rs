//! The gRPC side of the ring: translates `keel.ring.v1.Ring/Stream` and `Ring/Push` into
//! [`Mailbox::deliver`] and its refusals into status codes. Nothing else.
//!
//! `Ring/Stream`, the data path, is served by [`RingDataPlane`] straight from the HTTP/2 body
//! (see `wire`: the payloads are not copied); `Ring/Push` and anything else go to tonic's
//! generated server.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::Stream;
use http_body_util::{BodyExt, StreamBody};
use prost::Message;

use keel_proto::ring_rpc::ring_server::{Ring, RingServer};
use keel_proto::ring_rpc::{PushAck, RingFrame};
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::server::NamedService;
use tonic::{Request, Response, Status, Streaming};

use super::error::FrameRejected;
use super::mailbox::Mailbox;
use super::wire::{MAX_MESSAGE_BYTES, MessageReader, STREAM_PATH, encode_ack};

/// Implements the `Ring` gRPC service on top of a [`Mailbox`].
pub struct RingService {
    /// Where accepted frames go.
    mailbox: Arc<Mailbox>,
}

/// The ring service for a worker's tonic server ([`RingDataPlane`]), with message limits of
/// [`MAX_MESSAGE_BYTES`]. Add it to the same server as the control service; build that server
/// with [`super::tune_server`] for throughput.
pub fn ring_service(mailbox: Arc<Mailbox>) -> RingDataPlane {
    let generated = RingServer::new(RingService {
        mailbox: Arc::clone(&mailbox),
    })
    .max_decoding_message_size(MAX_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_MESSAGE_BYTES);
    RingDataPlane { mailbox, generated }
}

/// The `keel.ring.v1.Ring` service as a worker serves it: `Ring/Stream` read straight from the
/// HTTP/2 body without copying payloads, every other method through tonic's generated server.
#[derive(Clone)]
pub struct RingDataPlane {
    /// Where accepted frames go.
    mailbox: Arc<Mailbox>,
    /// `Ring/Push`, and `UNIMPLEMENTED` for unknown methods.
    generated: RingServer<RingService>,
}

impl NamedService for RingDataPlane {
    const NAME: &'static str = "keel.ring.v1.Ring";
}

impl Service<http::Request<Body>> for RingDataPlane {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<http::Response<Body>, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if req.uri().path() == STREAM_PATH {
            let response = stream_response(Arc::clone(&self.mailbox), req.into_body());
            Box::pin(async move { Ok(response) })
        } else {
            Box::pin(self.generated.call(req))
        }
    }
}

/// One item of a `Ring/Stream` response body: an ack, or the trailers that end the call.
type BodyFrame = Result<http_body::Frame<Bytes>, Infallible>;

/// The response to one `Ring/Stream` call: every frame in `body` is delivered to `mailbox` in
/// order and answered with one ack; the call ends with `grpc-status` trailers (OK at the end of
/// the request, else the status of an undecodable, oversized or truncated message).
fn stream_response(mailbox: Arc<Mailbox>, body: Body) -> http::Response<Body> {
    let state = StreamCall {
        body,
        reader: MessageReader::new(MAX_MESSAGE_BYTES),
        mailbox,
        ended: false,
    };
    let frames = futures::stream::unfold(state, |mut call| async move {
        if call.ended {
            return None;
        }
        let frame = match call.next_ack().await {
            Ok(Some(ack)) => http_body::Frame::data(encode_ack(&ack)),
            Ok(None) => {
                call.ended = true;
                trailers(&Status::ok(""))
            }
            Err(status) => {
                call.ended = true;
                trailers(&status)
            }
        };
        Some((Ok(frame), call))
    });
    let frames: Pin<Box<dyn Stream<Item = BodyFrame> + Send>> = Box::pin(frames);
    let mut response = http::Response::new(Body::new(StreamBody::new(frames)));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    response
}

/// The state of one `Ring/Stream` call on the receiving side.
struct StreamCall {
    /// The request body: the sender's DATA frames.
    body: Body,
    /// Splits them into messages.
    reader: MessageReader,
    /// Where frames go.
    mailbox: Arc<Mailbox>,
    /// Set once the trailers were produced.
    ended: bool,
}

impl StreamCall {
    /// Reads, decodes and delivers the next frame and returns its ack; `None` at the end of the
    /// request.
    ///
    /// Errors: the status that ends the call (a bad or truncated message, a broken body).
    async fn next_ack(&mut self) -> Result<Option<PushAck>, Status> {
        loop {
            if let Some(message) = self.reader.next_message()? {
                let frame = RingFrame::decode(message)
                    .map_err(|e| Status::internal(format!("a ring frame does not decode: {e}")))?;
                return Ok(Some(deliver_and_ack(&self.mailbox, frame).await));
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    // Trailers from a client carry nothing we use.
                    if let Ok(data) = frame.into_data() {
                        self.reader.push(data);
                    }
                }
                Some(Err(e)) => return Err(Status::from_error(Box::new(e))),
                None if self.reader.is_empty() => return Ok(None),
                None => {
                    return Err(Status::internal(
                        "the ring stream ended in the middle of a message",
                    ));
                }
            }
        }
    }
}

/// Delivers `frame` to `mailbox` and answers it: code 0, or the refusal's status code and reason.
async fn deliver_and_ack(mailbox: &Mailbox, frame: RingFrame) -> PushAck {
    match mailbox.deliver(frame).await {
        Ok(()) => PushAck::default(),
        Err(rejected) => {
            let status = Status::from(rejected);
            PushAck {
                code: status.code() as u32,
                message: status.message().to_string(),
            }
        }
    }
}

/// The trailers ending a call with `status`.
fn trailers(status: &Status) -> http_body::Frame<Bytes> {
    let mut map = http::HeaderMap::new();
    if status.add_header(&mut map).is_err() {
        // Only a message that cannot be a header value fails; send the code alone.
        let _ = Status::new(status.code(), "").add_header(&mut map);
    }
    http_body::Frame::trailers(map)
}

impl From<FrameRejected> for Status {
    fn from(rejected: FrameRejected) -> Status {
        let message = rejected.to_string();
        match rejected {
            FrameRejected::Malformed(_)
            | FrameRejected::LengthMismatch { .. }
            | FrameRejected::DtypeMismatch { .. }
            | FrameRejected::CollectiveMismatch { .. }
            | FrameRejected::UnknownAllReduce { .. }
            | FrameRejected::Unplanned { .. } => Status::invalid_argument(message),
            FrameRejected::Duplicate { .. } => Status::already_exists(message),
            FrameRejected::NotJoined { .. } => Status::unavailable(message),
            FrameRejected::WrongJob { .. } => Status::not_found(message),
            FrameRejected::StaleGeneration { .. } => Status::failed_precondition(message),
            // Not the sender's fault: see `Ring::send`'s handling of `ABORTED`.
            FrameRejected::Finished { .. } => Status::aborted(message),
        }
    }
}

/// The acks of one `Ring/Stream` call, one per frame, in order.
pub type AckStream = Pin<Box<dyn Stream<Item = Result<PushAck, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Ring for RingService {
    type StreamStream = AckStream;

    /// tonic's decoding of `Ring/Stream` (copies every payload). A worker serves the stream
    /// through [`RingDataPlane`] instead; this stays for a plain `RingServer<RingService>`.
    async fn stream(
        &self,
        request: Request<Streaming<RingFrame>>,
    ) -> Result<Response<AckStream>, Status> {
        let frames = request.into_inner();
        let mailbox = Arc::clone(&self.mailbox);
        // Frames are delivered one after another (waiting for room when the mailbox is full,
        // which throttles the sender through HTTP/2 flow control) and acked in order.
        let acks = futures::stream::unfold(
            (frames, mailbox, false),
            |(mut frames, mailbox, failed)| async move {
                if failed {
                    return None;
                }
                match frames.message().await {
                    Ok(Some(frame)) => {
                        let ack = deliver_and_ack(&mailbox, frame).await;
                        Some((Ok(ack), (frames, mailbox, false)))
                    }
                    Ok(None) => None,
                    // Undecodable or oversized message: end the call with its status.
                    Err(status) => Some((Err(status), (frames, mailbox, true))),
                }
            },
        );
        Ok(Response::new(Box::pin(acks)))
    }

    async fn push(&self, request: Request<RingFrame>) -> Result<Response<PushAck>, Status> {
        self.mailbox.deliver(request.into_inner()).await?;
        Ok(Response::new(PushAck::default()))
    }
}
