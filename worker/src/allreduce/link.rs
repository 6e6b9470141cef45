//! One stream of a ring link: a long-lived bidirectional `Ring/Stream` call to the right
//! neighbour, run by a background task. Frames go out in order; the receiver acknowledges each
//! in order, so the n-th ack answers the n-th frame. Streaming avoids a request's headers,
//! task spawn and status per frame (measured: unary calls cost far more CPU per frame).
//!
//! When the call fails (connection lost), every frame awaiting its ack fails with the call's
//! status and the next frame opens a new call (the channel reconnects).

use std::collections::VecDeque;

use keel_proto::auth::AuthChannel;
use keel_proto::ring_rpc::ring_client::RingClient;
use keel_proto::ring_rpc::{PushAck, RingFrame};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Code, Status};

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
    /// Starts the background task for `client` (one connection). Needs a tokio runtime.
    pub(crate) fn spawn(client: RingClient<AuthChannel>) -> LinkStream {
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

/// The background task: one call at a time, re-opened after a failure when a frame comes.
async fn run(mut client: RingClient<AuthChannel>, mut rx: mpsc::UnboundedReceiver<Outbound>) {
    let mut next: Option<Outbound> = None;
    loop {
        let first = match next.take() {
            Some(o) => o,
            None => match rx.recv().await {
                Some(o) => o,
                None => return,
            },
        };
        let (req_tx, req_rx) = mpsc::unbounded_channel::<RingFrame>();
        let mut pending: VecDeque<oneshot::Sender<Ack>> = VecDeque::new();
        // A fresh unbounded channel whose receiver is alive: cannot fail.
        let _ = req_tx.send(first.frame);
        pending.push_back(first.done);
        let mut acks = match client.stream(UnboundedReceiverStream::new(req_rx)).await {
            Ok(response) => response.into_inner(),
            Err(status) => {
                fail_all(&mut pending, &status);
                continue;
            }
        };
        loop {
            tokio::select! {
                out = rx.recv() => match out {
                    Some(o) => {
                        if req_tx.send(o.frame).is_err() {
                            let _ = o.done.send(Err(Status::unavailable("ring stream closed")));
                        } else {
                            pending.push_back(o.done);
                        }
                    }
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
