//! All-reduce correctness over real tonic servers on 127.0.0.1: world sizes 1-4, odd lengths,
//! exact sums for integer-valued inputs, bit-identical results on every rank and every run, and
//! frames that arrive before the local call are buffered.

mod allreduce_support;

use std::time::Duration;

use allreduce_support::{all_reduce, connect_all, integer_input, random_input, start_peers};

fn sequential_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
    let mut sum = vec![0.0f32; inputs[0].len()];
    for input in inputs {
        for (s, x) in sum.iter_mut().zip(input) {
            *s += x;
        }
    }
    sum
}

#[test]
fn integer_sums_are_exact_for_world_1_to_4_and_odd_lengths() {
    for n in 1..=4 {
        let peers = start_peers(n);
        let rings = connect_all(&peers, 1, |_| {});
        for (bucket, len) in [0usize, 1, 3, 5, 1_000_003].into_iter().enumerate() {
            let inputs: Vec<_> = (0..n).map(|r| integer_input(r, len)).collect();
            let expected = sequential_sum(&inputs);
            let outputs = all_reduce(&peers, &rings, 1, bucket as u32, inputs);
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
fn float_sums_match_and_are_bit_identical_on_every_rank_and_run() {
    let n = 3;
    let len = 1_000_003;
    let peers = start_peers(n);
    let rings = connect_all(&peers, 1, |cfg| {
        cfg.frame_bytes = 256 << 10;
        cfg.streams_per_link = 3;
    });
    let inputs: Vec<_> = (0..n).map(|r| random_input(r, len, 3)).collect();
    let expected = sequential_sum(&inputs);
    let mut first_run: Option<Vec<u32>> = None;
    for step in 0..3 {
        let outputs = all_reduce(&peers, &rings, step, 0, inputs.clone());
        let bits: Vec<Vec<u32>> = outputs
            .into_iter()
            .map(|o| o.unwrap().iter().map(|x| x.to_bits()).collect())
            .collect();
        for (rank, b) in bits.iter().enumerate() {
            assert!(
                *b == bits[0],
                "rank {rank} differs from rank 0 at step {step}"
            );
        }
        match &first_run {
            None => first_run = Some(bits[0].clone()),
            Some(first) => assert!(*first == bits[0], "step {step} differs from step 0"),
        }
        for (i, (got, want)) in bits[0].iter().zip(&expected).enumerate() {
            let got = f32::from_bits(*got);
            assert!((got - want).abs() <= 1e-5, "element {i}: {got} vs {want}");
        }
    }
}

#[test]
fn frames_that_arrive_before_the_local_call_are_buffered() {
    let peers = start_peers(2);
    let rings = connect_all(&peers, 1, |_| {});
    let len = 300_001;
    let inputs: Vec<_> = (0..2).map(|r| integer_input(r, len)).collect();
    let expected = sequential_sum(&inputs);
    // Rank 0 starts alone: its first chunk must wait in rank 1's mailbox.
    let ring0 = rings[0].clone();
    let data0 = inputs[0].clone();
    let early = peers[0]
        .rt
        .spawn(async move { ring0.all_reduce_sum(9, 4, data0).await });
    let mut buffered = 0;
    for _ in 0..200 {
        buffered = peers[1].mailbox.held_bytes();
        if buffered > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(buffered > 0, "nothing buffered at rank 1 before its call");
    let ring1 = rings[1].clone();
    let data1 = inputs[1].clone();
    let late = peers[1]
        .rt
        .spawn(async move { ring1.all_reduce_sum(9, 4, data1).await });
    let out0 = peers[0].rt.block_on(early).unwrap().unwrap();
    let out1 = peers[1].rt.block_on(late).unwrap().unwrap();
    assert!(out0 == expected && out1 == expected);
    assert_eq!(
        peers[1].mailbox.held_bytes(),
        0,
        "consumed frames must release the buffer"
    );
}

#[test]
fn many_buckets_in_flight_at_once() {
    let n = 3;
    let peers = start_peers(n);
    let rings = connect_all(&peers, 1, |cfg| cfg.frame_bytes = 4096);
    // Every rank runs buckets 0..8 concurrently on its own runtime.
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let ring = rings[rank].clone();
            peers[rank].rt.spawn(async move {
                let tasks = (0..8u32).map(|bucket| {
                    let ring = ring.clone();
                    async move {
                        let data = integer_input(rank + bucket as usize, 10_007);
                        ring.all_reduce_sum(5, bucket, data).await
                    }
                });
                futures::future::join_all(tasks).await
            })
        })
        .collect();
    let results: Vec<_> = handles
        .into_iter()
        .zip(&peers)
        .map(|(h, p)| p.rt.block_on(h).unwrap())
        .collect();
    for bucket in 0..8usize {
        let inputs: Vec<_> = (0..n).map(|r| integer_input(r + bucket, 10_007)).collect();
        let expected = sequential_sum(&inputs);
        for rank_results in &results {
            assert!(*rank_results[bucket].as_ref().unwrap() == expected);
        }
    }
}

/// Regression: a worker's second job (same generation 1, same step 0 and bucket as the first
/// job's) was refused as "already running or finished on this worker", so a long-running
/// worker could only ever run one job.
#[test]
fn a_second_job_on_the_same_workers_reuses_steps_and_buckets() {
    let n = 2;
    let peers = start_peers(n);
    for job in ["job-1", "job-2", "job-3"] {
        let rings = connect_all(&peers, 1, |cfg| cfg.job_id = job.to_string());
        let inputs: Vec<_> = (0..n).map(|r| integer_input(r, 1001)).collect();
        let expected = sequential_sum(&inputs);
        for out in all_reduce(&peers, &rings, 0, 0, inputs) {
            let out = out.unwrap_or_else(|e| panic!("{job}: {e}"));
            assert!(out == expected, "{job}: wrong sum");
        }
    }
}
