//! `ring_frame`: `Ring/Stream` bytes through the worker's ring service ([`ring_service`], which
//! splits the HTTP/2 body into gRPC messages, decodes each `RingFrame` and delivers it) into a
//! [`Mailbox`] that joined a small ring.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use keel_worker::allreduce::fuzzing::{OpenAllReduce, join};
use keel_worker::allreduce::{Collective, Mailbox, WireDtype, ring_service};
use tonic::codegen::{Service, http};

/// The job the mailbox serves (seed frames carry it).
pub const JOB_ID: &str = "job-fuzz";
/// The generation the mailbox joined (seed frames carry it).
pub const GENERATION: u64 = 3;
/// Bytes of the input before the request body.
pub const HEAD_BYTES: usize = 7;

/// The ring's shape, the DATA frames and the all-reduce started, from the first 7 bytes:
/// - byte 0: world size (2 + bits 0..2, up to 5), rank (bits 2..5, modulo the world size);
/// - byte 1: frame elements (1 + the byte);
/// - byte 2: the all-reduce started before the stream (bit 0: one is; bits 1..3: its
///   collective; bit 3: bf16), its bucket (bits 4..8);
/// - byte 3: its length (1 + the byte, times 4), at step 7;
/// - bytes 4, 5: where the stream is cut in two (u16, little-endian, modulo its length);
/// - byte 6: the size of the DATA frames after the cut (0: all in one).
///
/// The rest is the request body: gRPC messages (a 5-byte prefix, then a `RingFrame`).
///
/// Delivery to the mailbox must not wait: the input is far below its byte budgets, so a
/// stream that does not end within 10 s is a bug (panics).
pub fn ring_frame(data: &[u8]) {
    let _ = deliver(data);
}

/// What a stream left in the mailbox.
#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    /// Frames the started all-reduce received.
    received: usize,
    /// Bytes the mailbox still holds (frames held ahead).
    held_bytes: usize,
}

/// [`ring_frame`], saying what the mailbox took (`None` for an input too short).
fn deliver(data: &[u8]) -> Option<Outcome> {
    if data.len() < HEAD_BYTES {
        return None;
    }
    let (head, body) = data.split_at(HEAD_BYTES);
    let world_size = 2 + usize::from(head[0] & 3);
    let rank = usize::from((head[0] >> 2) & 7) % world_size;
    let frame_elems = 1 + usize::from(head[1]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        let mailbox = Mailbox::new();
        join(&mailbox, JOB_ID, GENERATION, world_size, rank, frame_elems).expect("joined");
        let mut running = if head[2] & 1 == 1 {
            let collective = match (head[2] >> 1) & 3 {
                1 => Collective::ReduceScatter,
                2 => Collective::AllGather,
                _ => Collective::AllReduce,
            };
            let dtype = if head[2] & 8 != 0 {
                WireDtype::Bf16
            } else {
                WireDtype::F32
            };
            let len = (1 + usize::from(head[3])) * 4;
            let bucket = u32::from(head[2] >> 4);
            OpenAllReduce::open(
                &mailbox, JOB_ID, GENERATION, 7, bucket, len, dtype, collective,
            )
            .ok()
        } else {
            None
        };
        let cut = usize::from(u16::from_le_bytes([head[4], head[5]])) % (body.len() + 1);
        let piece = match head[6] {
            0 => body.len().max(1),
            n => usize::from(n),
        };
        let (first, rest) = body.split_at(cut);
        let mut chunks = vec![Bytes::copy_from_slice(first)];
        chunks.extend(rest.chunks(piece).map(Bytes::copy_from_slice));
        let frames = futures::stream::iter(
            chunks
                .into_iter()
                .map(|c| Ok::<_, Infallible>(http_body::Frame::data(c))),
        );
        let request = http::Request::builder()
            .method("POST")
            .uri("http://peer/keel.ring.v1.Ring/Stream")
            .header("content-type", "application/grpc")
            .body(tonic::body::Body::new(StreamBody::new(frames)))
            .expect("a request");
        let mut service = ring_service(Arc::clone(&mailbox));
        let answered = tokio::time::timeout(Duration::from_secs(10), async {
            let response = service.call(request).await.expect("infallible");
            // The acks and the trailers; a refused frame is an ack with its code.
            let _ = response.into_body().collect().await;
        })
        .await;
        assert!(
            answered.is_ok(),
            "the ring stream was not answered within 10 s: a delivery waited"
        );
        let received = running.as_mut().map_or(0, OpenAllReduce::drain);
        drop(running);
        Some(Outcome {
            received,
            held_bytes: mailbox.held_bytes(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/../fuzz/corpus/ring_frame/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    #[test]
    fn the_seeds_reach_the_mailbox_and_are_taken() {
        // One frame for the started all-reduce: received.
        let one = deliver(&seed("running-one-frame")).unwrap();
        assert_eq!((one.received, one.held_bytes), (1, 0));
        // Ring step 0 of an all-reduce not started here is held (16 bytes); ring step 1 cannot
        // come first and is refused.
        let ahead = deliver(&seed("ahead-two-frames-split")).unwrap();
        assert_eq!((ahead.received, ahead.held_bytes), (0, 16));
        // A bf16 frame taken once; its copy refused.
        let bf16 = deliver(&seed("running-bf16-duplicate")).unwrap();
        assert_eq!((bf16.received, bf16.held_bytes), (1, 0));
        // Another job's frame, an older generation's and a truncated message: nothing taken.
        let refused = deliver(&seed("refused-and-truncated")).unwrap();
        assert_eq!((refused.received, refused.held_bytes), (0, 0));
    }
}
