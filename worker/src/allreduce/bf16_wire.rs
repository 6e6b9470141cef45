//! Ring frames whose elements travel as bf16 (`RingFrame.dtype = WIRE_DTYPE_BF16`, the job's
//! `train.allreduce_dtype = "bf16"`): half the bytes of f32 on every hop.
//!
//! The arithmetic stays f32: a hop decodes the bf16 it receives, adds it into its f32 buffer,
//! and rounds that partial sum to bf16 (nearest even, `crate::model::bf16::bf16_bits`) only to
//! send it. The rank that finishes a chunk's sum rounds it in place before the all-gather sends
//! it, so it keeps exactly the values every other rank decodes: replicas stay bit-identical.
//!
//! Shapes: a frame of `k` elements carries `2 k` bytes, each element the high half of its f32
//! (little-endian u16).

use bytes::Bytes;
use keel_proto::ring_rpc::WireDtype;

use crate::model::bf16::bf16_bits;

/// Bytes per element of `dtype` on the wire.
pub(crate) fn element_bytes(dtype: WireDtype) -> usize {
    match dtype {
        WireDtype::F32 => 4,
        WireDtype::Bf16 => 2,
    }
}

/// `values` rounded to bf16, as a frame's payload (`2 * values.len()` bytes).
pub(super) fn encode(values: &[f32]) -> Bytes {
    let mut out = Vec::with_capacity(values.len() * 2);
    out.extend(values.iter().flat_map(|&v| bf16_bits(v).to_le_bytes()));
    Bytes::from(out)
}

/// The f32 of one bf16 element (its two little-endian bytes).
#[inline(always)]
fn decode(b: &[u8]) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
}

/// `local[i] += incoming[i]` (`incoming`: `2 * local.len()` bytes of bf16).
pub(super) fn add(local: &mut [f32], incoming: &[u8]) {
    for (a, b) in local.iter_mut().zip(incoming.chunks_exact(2)) {
        *a += decode(b);
    }
}

/// `local[i] = incoming[i]` (`incoming`: `2 * local.len()` bytes of bf16).
pub(super) fn copy(local: &mut [f32], incoming: &[u8]) {
    for (a, b) in local.iter_mut().zip(incoming.chunks_exact(2)) {
        *a = decode(b);
    }
}

/// Rounds `local` to bf16 in place: a finished sum, made equal to what its all-gather sends.
pub(super) fn round_in_place(local: &mut [f32]) {
    for x in local {
        *x = f32::from_bits(u32::from(bf16_bits(*x)) << 16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_is_the_rounded_high_half_and_decodes_exactly() {
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: nearest even is 1. 1 + 3 * 2^-8 rounds up.
        let values = [
            1.0f32,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            -2.5,
            0.0,
            f32::INFINITY,
        ];
        let bytes = encode(&values);
        assert_eq!(bytes.len(), 2 * values.len());
        let mut back = vec![0.0f32; values.len()];
        copy(&mut back, &bytes);
        assert_eq!(
            back,
            [1.0, 1.0, 1.0 + 4.0 / 256.0, -2.5, 0.0, f32::INFINITY]
        );
        let mut rounded = values.to_vec();
        round_in_place(&mut rounded);
        assert_eq!(rounded, back);
        // NaN stays NaN: a step with a non-finite gradient is still skipped on every rank.
        copy(&mut back[..1], &encode(&[f32::NAN]));
        assert!(back[0].is_nan());
    }

    #[test]
    fn add_decodes_then_adds_in_f32() {
        let mut local = vec![1.0f32, 2.0, -3.0];
        add(&mut local, &encode(&[0.5, 1.0 / 1024.0, 3.0]));
        // 2 + 2^-10 is exact in f32 (the sum is not rounded to bf16 here).
        assert_eq!(local, [1.5, 2.0 + 1.0 / 1024.0, 0.0]);
    }
}
