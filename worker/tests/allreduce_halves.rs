//! The ring's two halves as collectives of their own (ZeRO stage 1, `train.shard_optimizer`),
//! over real tonic servers on 127.0.0.1: a reduce-scatter leaves each rank the all-reduce's sum
//! of its own chunk, bit for bit (f32 and bf16 on the wire); an all-gather of every rank's
//! chunk gives every rank the whole buffer; together they are the all-reduce; each sends half
//! the all-reduce's bytes; frames of an all-gather that arrive before the local call are kept;
//! ranks that disagree on the collective fail naming it.

mod allreduce_support;

use std::time::Duration;

use allreduce_support::{
    Peer, all_reduce_as, connect_all, random_input, ring_bytes_sent, run_collective, serial,
    start_peers,
};
use keel_worker::allreduce::{Collective, Ring, WireDtype, owned_chunk};
use std::sync::Arc;

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Reduce-scatter then all-gather of `inputs` as (step, buckets 0 and 1); returns every rank's
/// reduce-scatter output and all-gather output.
fn scatter_then_gather(
    peers: &[Peer],
    rings: &[Arc<Ring>],
    step: u64,
    inputs: Vec<Vec<f32>>,
    dtype: WireDtype,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let n = peers.len();
    let len = inputs[0].len();
    let scattered: Vec<Vec<f32>> = run_collective(
        peers,
        rings,
        (step, 0),
        inputs,
        &[dtype],
        &[Collective::ReduceScatter],
        None,
    )
    .into_iter()
    .map(|r| r.unwrap())
    .collect();
    // Each rank contributes only its chunk: the rest is NaN, which must not reach anyone.
    let contributions: Vec<Vec<f32>> = scattered
        .iter()
        .enumerate()
        .map(|(rank, s)| {
            let own = owned_chunk(len, n, rank);
            let mut c = vec![f32::NAN; len];
            c[own.clone()].copy_from_slice(&s[own]);
            c
        })
        .collect();
    let gathered: Vec<Vec<f32>> = run_collective(
        peers,
        rings,
        (step, 1),
        contributions,
        &[WireDtype::F32],
        &[Collective::AllGather],
        None,
    )
    .into_iter()
    .map(|r| r.unwrap())
    .collect();
    (scattered, gathered)
}

#[test]
fn scatter_then_gather_is_the_all_reduce_bit_for_bit() {
    let _serial = serial();
    for n in 1..=4 {
        let peers = start_peers(n);
        let rings = connect_all(&peers, 1, |cfg| cfg.frame_bytes = 16 << 10);
        for (step, len) in [0usize, 1, 5, 300_007].into_iter().enumerate() {
            for dtype in [WireDtype::F32, WireDtype::Bf16] {
                let inputs: Vec<_> = (0..n).map(|r| random_input(r, len, 7)).collect();
                let step = 2 * step as u64 + u64::from(dtype == WireDtype::Bf16);
                let reduced: Vec<Vec<f32>> =
                    all_reduce_as(&peers, &rings, step, 2, inputs.clone(), &[dtype])
                        .into_iter()
                        .map(|r| r.unwrap())
                        .collect();
                let (scattered, gathered) =
                    scatter_then_gather(&peers, &rings, step, inputs, dtype);
                for rank in 0..n {
                    let own = owned_chunk(len, n, rank);
                    assert_eq!(
                        bits(&scattered[rank][own.clone()]),
                        bits(&reduced[rank][own]),
                        "world {n} len {len} {dtype:?} rank {rank}: its chunk of the reduce-scatter"
                    );
                    assert_eq!(
                        bits(&gathered[rank]),
                        bits(&reduced[0]),
                        "world {n} len {len} {dtype:?} rank {rank}: the all-gather"
                    );
                }
            }
        }
    }
}

#[test]
fn each_half_sends_half_the_all_reduces_bytes() {
    let _serial = serial();
    let (n, len) = (3, 600_000);
    let peers = start_peers(n);
    let rings = connect_all(&peers, 1, |_| {});
    let inputs: Vec<_> = (0..n).map(|r| random_input(r, len, 3)).collect();
    let before = ring_bytes_sent();
    for r in all_reduce_as(&peers, &rings, 0, 0, inputs.clone(), &[WireDtype::F32]) {
        r.unwrap();
    }
    let all_reduce = ring_bytes_sent() - before;
    let before = ring_bytes_sent();
    for r in run_collective(
        &peers,
        &rings,
        (1, 0),
        inputs.clone(),
        &[WireDtype::F32],
        &[Collective::ReduceScatter],
        None,
    ) {
        r.unwrap();
    }
    let scatter = ring_bytes_sent() - before;
    let before = ring_bytes_sent();
    for r in run_collective(
        &peers,
        &rings,
        (2, 0),
        inputs,
        &[WireDtype::F32],
        &[Collective::AllGather],
        None,
    ) {
        r.unwrap();
    }
    let gather = ring_bytes_sent() - before;
    // All ranks of the process together: n ranks each send (n - 1) / n of the buffer per half.
    let half = (n - 1) as u64 * len as u64 * 4;
    assert!(
        scatter >= half && scatter < half + half / 50,
        "reduce-scatter sent {scatter} bytes, payload {half}"
    );
    assert!(
        gather >= half && gather < half + half / 50,
        "all-gather sent {gather} bytes, payload {half}"
    );
    assert!(
        all_reduce >= 2 * half && all_reduce < 2 * half + half / 25,
        "all-reduce sent {all_reduce} bytes"
    );
}

#[test]
fn all_gather_frames_that_arrive_before_the_local_call_are_kept() {
    let _serial = serial();
    let (n, len) = (3, 200_003);
    let peers = start_peers(n);
    let rings = connect_all(&peers, 1, |cfg| cfg.frame_bytes = 16 << 10);
    let inputs: Vec<_> = (0..n).map(|r| random_input(r, len, 5)).collect();
    let mut whole = vec![0.0f32; len];
    for (rank, input) in inputs.iter().enumerate() {
        let own = owned_chunk(len, n, rank);
        whole[own.clone()].copy_from_slice(&input[own]);
    }
    // Rank 1 starts late: its left neighbour's frames of every all-gather step wait for it.
    let outputs = run_collective(
        &peers,
        &rings,
        (0, 0),
        inputs,
        &[WireDtype::F32],
        &[Collective::AllGather],
        Some((1, Duration::from_millis(300))),
    );
    for (rank, out) in outputs.into_iter().enumerate() {
        assert_eq!(bits(&out.unwrap()), bits(&whole), "rank {rank}");
    }
}

#[test]
fn ranks_that_disagree_on_the_collective_fail_naming_it() {
    let _serial = serial();
    let peers = start_peers(2);
    let rings = connect_all(&peers, 1, |cfg| cfg.timeout = Duration::from_secs(3));
    let inputs: Vec<_> = (0..2).map(|r| random_input(r, 10_000, 1)).collect();
    let outputs = run_collective(
        &peers,
        &rings,
        (0, 0),
        inputs,
        &[WireDtype::F32],
        &[Collective::AllReduce, Collective::ReduceScatter],
        None,
    );
    let errors: Vec<String> = outputs
        .into_iter()
        .filter_map(|o| o.err().map(|e| e.to_string()))
        .collect();
    assert!(
        !errors.is_empty(),
        "a mixed all-reduce / reduce-scatter must fail"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("collective") || e.contains("shard_optimizer")),
        "{errors:?}"
    );
}
