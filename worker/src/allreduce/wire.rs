//! `Ring/Stream` messages on the wire without copying their payloads.
//!
//! The wire format is plain gRPC (HTTP/2, `application/grpc`, each message a 5-byte prefix
//! then a protobuf `RingFrame`), so any gRPC client can still call the ring. What differs from
//! tonic's generated code is who touches the bytes: tonic encodes every message into a fresh
//! buffer (a copy of the payload) and decodes from a buffer it fills from HTTP/2's DATA frames
//! (another copy). On two cores those two copies of every gradient byte cost about as much CPU
//! as the reduction itself. Here the sender hands HTTP/2 the prefix and the header fields as one
//! small buffer and the payload as it is (a shared [`Bytes`]), and the receiver decodes from
//! the DATA frames as they came: a payload that arrived in one DATA frame is sliced, not copied.

use std::collections::VecDeque;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use keel_proto::ring_rpc::{PushAck, RingFrame};
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint};
use tonic::Status;

use super::mailbox::MAX_FRAME_BYTES;

/// Message size limit of the ring service, bytes: the largest frame plus room for its header
/// fields (tonic's default of 4 MiB would refuse a full [`MAX_FRAME_BYTES`] frame).
pub const MAX_MESSAGE_BYTES: usize = MAX_FRAME_BYTES + (64 << 10);

/// The HTTP/2 path of `keel.ring.v1.Ring/Stream`.
pub(crate) const STREAM_PATH: &str = "/keel.ring.v1.Ring/Stream";

/// gRPC's message prefix: a compression flag (1 byte), then the length (u32, big-endian).
const PREFIX_BYTES: usize = 5;

/// Protobuf field number of `RingFrame.data` (see ring.proto).
const DATA_FIELD: u32 = 9;

/// `frame` as one gRPC message in two pieces: the prefix and every field but `data` (a small
/// new buffer), then `data` itself (the same [`Bytes`], not copied). Sent back to back, the two
/// are what tonic would send for `frame`, byte for byte when `dtype` is f32 (0, not written);
/// a bf16 frame's `dtype` (field 10) comes before `data` (field 9) instead of after it, which
/// every protobuf parser accepts (fields may come in any order).
///
/// Errors: `OUT_OF_RANGE` when the message would exceed [`MAX_MESSAGE_BYTES`] (what the
/// receiver accepts).
pub(crate) fn encode_frame(frame: &RingFrame) -> Result<[Bytes; 2], Status> {
    let fields = RingFrame {
        data: Bytes::new(),
        job_id: frame.job_id.clone(),
        ..*frame
    };
    let data_len = frame.data.len();
    let data_field_len = if data_len == 0 {
        0
    } else {
        // One byte of key (field 9, length-delimited) plus the length varint.
        1 + encoded_len_varint(data_len as u64) + data_len
    };
    let message_len = fields.encoded_len() + data_field_len;
    if message_len > MAX_MESSAGE_BYTES {
        return Err(Status::out_of_range(format!(
            "a ring frame of {data_len} payload bytes is over the message limit of \
             {MAX_MESSAGE_BYTES} bytes"
        )));
    }
    // At most MAX_MESSAGE_BYTES (a few MiB): fits the prefix's u32.
    let message_len = message_len as u32;
    let mut head = BytesMut::with_capacity(PREFIX_BYTES + fields.encoded_len() + 11);
    head.put_u8(0);
    head.put_u32(message_len);
    // `BytesMut` grows as needed: encoding into it cannot run out of room.
    fields
        .encode(&mut head)
        .map_err(|e| Status::internal(format!("encoding a ring frame: {e}")))?;
    if data_len > 0 {
        encode_key(DATA_FIELD, WireType::LengthDelimited, &mut head);
        encode_varint(data_len as u64, &mut head);
    }
    Ok([head.freeze(), frame.data.clone()])
}

/// `ack` as one gRPC message (prefix and protobuf), in one buffer (acks are a few bytes).
pub(crate) fn encode_ack(ack: &PushAck) -> Bytes {
    let len = ack.encoded_len();
    let mut out = BytesMut::with_capacity(PREFIX_BYTES + len);
    out.put_u8(0);
    // An ack is a status code and a short message: far below 4 GiB.
    out.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    // `BytesMut` grows as needed: encoding into it cannot run out of room.
    let _ = ack.encode(&mut out);
    out.freeze()
}

/// Splits a byte stream (the DATA frames of one call) into gRPC messages, keeping the frames'
/// buffers: a message is handed out as the list of slices it spans.
pub(crate) struct MessageReader {
    /// Received bytes not yet handed out, in order.
    buffered: Segments,
    /// Length of the message whose prefix was read, when its body is still incomplete.
    pending: Option<usize>,
    /// Largest accepted message, bytes (prefix excluded).
    max_message_bytes: usize,
}

impl MessageReader {
    /// A reader refusing messages over `max_message_bytes`.
    pub(crate) fn new(max_message_bytes: usize) -> MessageReader {
        MessageReader {
            buffered: Segments {
                parts: VecDeque::new(),
                remaining: 0,
            },
            pending: None,
            max_message_bytes,
        }
    }

    /// Appends received bytes (one DATA frame's payload).
    pub(crate) fn push(&mut self, chunk: Bytes) {
        if !chunk.is_empty() {
            self.buffered.remaining += chunk.len();
            self.buffered.parts.push_back(chunk);
        }
    }

    /// Whether nothing is buffered (at the end of the call: no truncated message).
    pub(crate) fn is_empty(&self) -> bool {
        self.buffered.remaining == 0 && self.pending.is_none()
    }

    /// The next complete message, or `None` until more bytes come.
    ///
    /// Errors: `INTERNAL` for a compressed message (Keel never compresses gradients) or a bad
    /// compression flag, `OUT_OF_RANGE` for a message over the limit (as tonic reports them).
    pub(crate) fn next_message(&mut self) -> Result<Option<Segments>, Status> {
        if self.pending.is_none() {
            if self.buffered.remaining < PREFIX_BYTES {
                return Ok(None);
            }
            let mut prefix = self.buffered.split_front(PREFIX_BYTES);
            let flag = prefix.get_u8();
            let len = prefix.get_u32() as usize;
            match flag {
                0 => {}
                // A compressed message on a call without `grpc-encoding` (this server accepts
                // none): INTERNAL, as the gRPC compression spec requires.
                1 => {
                    return Err(Status::internal(
                        "protocol error: a compressed ring frame, but this server accepts no \
                         grpc-encoding: send frames uncompressed",
                    ));
                }
                f => {
                    return Err(Status::internal(format!(
                        "protocol error: invalid compression flag {f} (valid flags are 0 and 1)"
                    )));
                }
            }
            if len > self.max_message_bytes {
                return Err(Status::out_of_range(format!(
                    "a ring message of {len} bytes is over the limit of {} bytes",
                    self.max_message_bytes
                )));
            }
            self.pending = Some(len);
        }
        match self.pending {
            Some(len) if self.buffered.remaining >= len => {
                self.pending = None;
                Ok(Some(self.buffered.split_front(len)))
            }
            _ => Ok(None),
        }
    }
}

/// One message's bytes as the slices of the DATA frames it arrived in. Decoding a `bytes`
/// field that lies within one slice ([`Buf::copy_to_bytes`]) shares that slice; only a field
/// that spans slices is copied.
pub(crate) struct Segments {
    /// The slices, in order; none empty.
    parts: VecDeque<Bytes>,
    /// Total length of `parts`, bytes.
    remaining: usize,
}

impl Buf for Segments {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.parts.front().map_or(&[], |b| b.as_ref())
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.remaining, "advance past the end of a message");
        self.remaining -= cnt;
        while cnt > 0 {
            let Some(front) = self.parts.front_mut() else {
                return;
            };
            if front.len() <= cnt {
                cnt -= front.len();
                self.parts.pop_front();
            } else {
                front.advance(cnt);
                cnt = 0;
            }
        }
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        assert!(len <= self.remaining, "`len` greater than remaining");
        match self.parts.front_mut() {
            Some(front) if front.len() >= len => {
                let out = front.split_to(len);
                if front.is_empty() {
                    self.parts.pop_front();
                }
                self.remaining -= len;
                out
            }
            _ => {
                let mut out = BytesMut::with_capacity(len);
                out.put(self.split_front(len));
                out.freeze()
            }
        }
    }
}

impl Segments {
    /// The first `len` bytes as their own `Segments` (`len <= remaining`).
    fn split_front(&mut self, len: usize) -> Segments {
        let mut parts = VecDeque::new();
        let mut left = len;
        while left > 0 {
            let Some(front) = self.parts.front_mut() else {
                break;
            };
            if front.len() <= left {
                left -= front.len();
                parts.extend(self.parts.pop_front());
            } else {
                parts.push_back(front.split_to(left));
                left = 0;
            }
        }
        self.remaining -= len - left;
        Segments {
            parts,
            remaining: len - left,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(data: Vec<u8>) -> RingFrame {
        RingFrame {
            job_id: "job-7".into(),
            generation: 3,
            step: 41,
            bucket: 2,
            sender_rank: 1,
            ring_step: 1,
            total_len: 1 << 20,
            offset: 4096,
            data: Bytes::from(data),
            dtype: 0,
            collective: 0,
        }
    }

    /// What tonic's prost codec sends for `frame`: prefix plus `encode_to_vec`.
    fn tonic_bytes(frame: &RingFrame) -> Vec<u8> {
        let body = frame.encode_to_vec();
        let mut out = vec![0u8];
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(&body);
        out
    }

    #[test]
    fn encoding_matches_tonic_byte_for_byte_and_shares_the_payload() {
        for data in [
            vec![],
            vec![7u8; 3],
            (0..=255u8).cycle().take(300_000).collect(),
        ] {
            let f = frame(data);
            let [head, payload] = encode_frame(&f).unwrap();
            let mut wire = head.to_vec();
            wire.extend_from_slice(&payload);
            assert_eq!(wire, tonic_bytes(&f), "{} payload bytes", f.data.len());
            assert_eq!(payload.as_ptr(), f.data.as_ptr(), "payload was copied");
        }
    }

    #[test]
    fn a_bf16_frame_decodes_to_itself_with_its_dtype_ahead_of_the_payload() {
        let f = RingFrame {
            dtype: keel_proto::ring_rpc::WireDtype::Bf16.into(),
            ..frame(vec![3u8; 1000])
        };
        let [head, payload] = encode_frame(&f).unwrap();
        let mut wire = head.to_vec();
        wire.extend_from_slice(&payload);
        // Field 10 precedes field 9 here (tonic writes it last): the same message.
        assert_eq!(wire.len(), tonic_bytes(&f).len());
        assert_eq!(RingFrame::decode(&wire[5..]).unwrap(), f);
    }

    #[test]
    fn a_frame_over_the_message_limit_is_refused_before_sending() {
        let f = frame(vec![0u8; MAX_MESSAGE_BYTES]);
        assert_eq!(
            encode_frame(&f).err().map(|s| s.code()),
            Some(tonic::Code::OutOfRange)
        );
    }

    #[test]
    fn messages_split_anywhere_decode_to_the_frames_sent() {
        let frames: Vec<RingFrame> = [vec![1u8; 1000], vec![], vec![9u8; 4]]
            .into_iter()
            .map(frame)
            .collect();
        let wire: Vec<u8> = frames.iter().flat_map(tonic_bytes).collect();
        for cut in [1, 2, 5, 7, 64, 999, 1003, wire.len()] {
            let mut reader = MessageReader::new(1 << 20);
            let mut got = Vec::new();
            for piece in wire.chunks(cut) {
                reader.push(Bytes::copy_from_slice(piece));
                while let Some(message) = reader.next_message().unwrap() {
                    got.push(RingFrame::decode(message).unwrap());
                }
            }
            assert_eq!(got, frames, "DATA frames of {cut} bytes");
            assert!(reader.is_empty());
        }
    }

    #[test]
    fn a_payload_in_one_data_frame_is_not_copied() {
        let f = frame(vec![5u8; 4096]);
        let [head, payload] = encode_frame(&f).unwrap();
        let mut reader = MessageReader::new(1 << 20);
        reader.push(head);
        reader.push(payload.clone());
        let message = reader.next_message().unwrap().unwrap();
        let decoded = RingFrame::decode(message).unwrap();
        assert_eq!(decoded.data.as_ptr(), payload.as_ptr());
    }

    #[test]
    fn oversized_compressed_and_bad_flags_are_refused_with_the_specs_codes() {
        let mut reader = MessageReader::new(100);
        reader.push(Bytes::from_static(&[0, 0, 0, 0, 101]));
        assert_eq!(
            reader.next_message().err().map(|s| s.code()),
            Some(tonic::Code::OutOfRange)
        );
        let mut reader = MessageReader::new(100);
        reader.push(Bytes::from_static(&[1, 0, 0, 0, 1, 0]));
        assert_eq!(
            reader.next_message().err().map(|s| s.code()),
            Some(tonic::Code::Internal)
        );
        let mut reader = MessageReader::new(100);
        reader.push(Bytes::from_static(&[2, 0, 0, 0, 1, 0]));
        assert_eq!(
            reader.next_message().err().map(|s| s.code()),
            Some(tonic::Code::Internal)
        );
    }

    #[test]
    fn a_truncated_message_leaves_the_reader_non_empty() {
        let wire = tonic_bytes(&frame(vec![3u8; 50]));
        let mut reader = MessageReader::new(1 << 20);
        reader.push(Bytes::copy_from_slice(&wire[..wire.len() - 1]));
        assert!(reader.next_message().unwrap().is_none());
        assert!(!reader.is_empty());
    }

    #[test]
    fn acks_match_tonic() {
        let ack = PushAck {
            code: 9,
            message: "older generation".into(),
        };
        let body = ack.encode_to_vec();
        let mut expected = vec![0u8];
        expected.extend_from_slice(&(body.len() as u32).to_be_bytes());
        expected.extend_from_slice(&body);
        assert_eq!(encode_ack(&ack).to_vec(), expected);
    }
}
