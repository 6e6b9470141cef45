//! The ring all-reduce with bf16 on the wire (`train.allreduce_dtype = "bf16"`), over real
//! tonic servers on 127.0.0.1: sums stay exact where bf16 holds the values, float sums are
//! bf16 values within the rounding of one bf16 step per hop and bit-identical on every rank,
//! the frames carry half the bytes of f32, and ranks that disagree on the dtype fail naming it.

mod allreduce_support;

use std::time::Duration;

use allreduce_support::{
    all_reduce_as, connect_all, integer_input, random_input, ring_bytes_sent, serial, start_peers,
};
use keel_worker::allreduce::WireDtype;

#[test]
fn bf16_sums_of_small_integers_are_exact_for_world_2_to_4() {
    let _serial = serial();
    for n in 2..=4 {
        let peers = start_peers(n);
        let rings = connect_all(&peers, 1, |_| {});
        for (bucket, len) in [1usize, 5, 100_003].into_iter().enumerate() {
            let inputs: Vec<_> = (0..n).map(|r| integer_input(r, len)).collect();
            let expected: Vec<f32> = (0..len)
                .map(|i| inputs.iter().map(|x| x[i]).sum())
                .collect();
            let outputs =
                all_reduce_as(&peers, &rings, 1, bucket as u32, inputs, &[WireDtype::Bf16]);
            for (rank, out) in outputs.into_iter().enumerate() {
                let out = out.unwrap_or_else(|e| panic!("world {n} len {len} rank {rank}: {e}"));
                assert!(
                    out == expected,
                    "world {n} len {len} rank {rank}: wrong sum"
                );
            }
        }
    }
}

#[test]
fn bf16_float_sums_are_rounded_alike_on_every_rank_and_take_half_the_bytes() {
    let _serial = serial();
    let n = 3;
    let len = 1_000_003;
    let peers = start_peers(n);
    let rings = connect_all(&peers, 1, |cfg| cfg.frame_bytes = 256 << 10);
    let inputs: Vec<_> = (0..n).map(|r| random_input(r, len, 5)).collect();

    let before = ring_bytes_sent();
    let f32_out = all_reduce_as(&peers, &rings, 0, 0, inputs.clone(), &[WireDtype::F32]);
    let f32_bytes = ring_bytes_sent() - before;
    let before = ring_bytes_sent();
    let outputs = all_reduce_as(&peers, &rings, 1, 0, inputs.clone(), &[WireDtype::Bf16]);
    let bf16_bytes = ring_bytes_sent() - before;
    // Every rank sends 2 (n - 1) / n of the buffer: 4 bytes an element in f32, 2 in bf16, plus
    // each frame's header.
    let elems = 2 * (n - 1) * len;
    assert!(f32_bytes >= 4 * elems as u64, "f32 sent {f32_bytes} bytes");
    assert!(
        bf16_bytes >= 2 * elems as u64 && bf16_bytes < f32_bytes * 51 / 100,
        "bf16 sent {bf16_bytes} bytes, f32 {f32_bytes}"
    );

    let f32_sum = f32_out[0].as_ref().unwrap();
    let outputs: Vec<Vec<f32>> = outputs.into_iter().map(|o| o.unwrap()).collect();
    for (rank, out) in outputs.iter().enumerate() {
        let same = out
            .iter()
            .zip(&outputs[0])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "rank {rank} differs from rank 0");
    }
    let mut worst = 0.0f64;
    for i in 0..len {
        let got = outputs[0][i];
        assert_eq!(
            got.to_bits() & 0xffff,
            0,
            "element {i}: {got} is not a bf16 value"
        );
        // Each of the n - 1 sends and the final rounding errs by at most half a bf16 step
        // (2^-8 of the value: 8 significant bits) of a partial sum no larger than the sum of
        // magnitudes.
        let magnitude: f32 = inputs.iter().map(|x| x[i].abs()).sum();
        let err = (got - f32_sum[i]).abs();
        assert!(
            err <= n as f32 * magnitude / 256.0 + f32::EPSILON,
            "element {i}: {got} vs f32 sum {}",
            f32_sum[i]
        );
        worst = worst.max(f64::from(err / magnitude.max(f32::MIN_POSITIVE)));
    }
    // And it is bf16's rounding, not a bug that happens to stay small: some element is off.
    assert!(worst > 1.0 / 4096.0, "largest relative error {worst}");
}

#[test]
fn ranks_that_disagree_on_the_dtype_fail_naming_it() {
    let _serial = serial();
    let peers = start_peers(2);
    let rings = connect_all(&peers, 1, |cfg| cfg.timeout = Duration::from_secs(3));
    let inputs: Vec<_> = (0..2).map(|r| integer_input(r, 10_000)).collect();
    let outputs = all_reduce_as(
        &peers,
        &rings,
        0,
        0,
        inputs,
        &[WireDtype::Bf16, WireDtype::F32],
    );
    let errors: Vec<String> = outputs
        .into_iter()
        .map(|o| {
            o.expect_err("a mixed-dtype all-reduce must fail")
                .to_string()
        })
        .collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("dtype") || e.contains("allreduce_dtype")),
        "{errors:?}"
    );
}
