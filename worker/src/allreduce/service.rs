//! The gRPC side of the ring: translates `keel.ring.v1.Ring/Stream` and `Ring/Push` into
//! [`Mailbox::deliver`] and its refusals into status codes. Nothing else.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;

use keel_proto::ring_rpc::ring_server::{Ring, RingServer};
use keel_proto::ring_rpc::{PushAck, RingFrame};
use tonic::{Request, Response, Status, Streaming};

use super::error::FrameRejected;
use super::mailbox::{MAX_FRAME_BYTES, Mailbox};

/// Message size limit of the ring service, bytes: the largest frame plus room for its header
/// fields (tonic's default of 4 MiB would refuse a full [`MAX_FRAME_BYTES`] frame).
pub const MAX_MESSAGE_BYTES: usize = MAX_FRAME_BYTES + (64 << 10);

/// Implements the `Ring` gRPC service on top of a [`Mailbox`].
pub struct RingService {
    /// Where accepted frames go.
    mailbox: Arc<Mailbox>,
}

/// The ring service for a worker's tonic server, with decode limits raised to
/// [`MAX_MESSAGE_BYTES`]. Add it to the same server as the control service; build that server
/// with [`super::tune_server`] for throughput.
pub fn ring_service(mailbox: Arc<Mailbox>) -> RingServer<RingService> {
    RingServer::new(RingService { mailbox })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

impl From<FrameRejected> for Status {
    fn from(rejected: FrameRejected) -> Status {
        let message = rejected.to_string();
        match rejected {
            FrameRejected::Malformed(_)
            | FrameRejected::LengthMismatch { .. }
            | FrameRejected::UnknownAllReduce { .. } => Status::invalid_argument(message),
            FrameRejected::NotJoined { .. } => Status::unavailable(message),
            FrameRejected::WrongJob { .. } => Status::not_found(message),
            FrameRejected::StaleGeneration { .. } | FrameRejected::Finished { .. } => {
                Status::failed_precondition(message)
            }
        }
    }
}

/// The acks of one `Ring/Stream` call, one per frame, in order.
pub type AckStream = Pin<Box<dyn Stream<Item = Result<PushAck, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Ring for RingService {
    type StreamStream = AckStream;

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
                        let ack = match mailbox.deliver(frame).await {
                            Ok(()) => PushAck::default(),
                            Err(rejected) => {
                                let status = Status::from(rejected);
                                PushAck {
                                    code: status.code() as u32,
                                    message: status.message().to_string(),
                                }
                            }
                        };
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
