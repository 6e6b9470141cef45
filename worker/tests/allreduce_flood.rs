//! Abuse case 4 (`scripts/abuse.sh`), over real tonic servers on 127.0.0.1: a hostile (but admitted) sender
//! posing as rank 0's left neighbour floods rank 0 with frames of all-reduces that will never
//! run here (a bucket that does not exist, steps out of reach) and frames that fit no planned
//! frame (4 MiB payloads where the ring plans 64 KiB frames). Once, 65 such frames filled the
//! 256 MiB mailbox, the ring's real frames then waited for room, and the all-reduce timed out;
//! what was held stayed held until the generation changed. Now frames outside the plan are
//! refused, what is held for all-reduces not started here is bounded apart from the running
//! ones, and it is freed once the step has moved past it.

mod allreduce_support;

use std::time::Duration;

use allreduce_support::{all_reduce, connect_all, start_peers};
use bytes::Bytes;
use keel_proto::ring_rpc::RingFrame;
use keel_proto::ring_rpc::ring_client::RingClient;
use keel_worker::allreduce::{MAX_FRAME_BYTES, MAX_MESSAGE_BYTES};
use tonic::Code;

/// The ring's frame size in these tests (`allreduce_support::config`), bytes.
const FRAME_BYTES: usize = 64 << 10;

fn junk(step: u64, bucket: u32, total_len: u64, offset: u64, bytes: usize) -> RingFrame {
    RingFrame {
        job_id: "job-test".to_string(),
        generation: 1,
        step,
        bucket,
        sender_rank: 1,
        ring_step: 0,
        total_len,
        offset,
        data: Bytes::from(vec![0u8; bytes]),
        dtype: 0,
        collective: 0,
    }
}

fn integer_input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 3 + rank * 11) % 37) as f32 - 18.0)
        .collect()
}

#[test]
fn a_flood_of_unplanned_frames_neither_stalls_the_ring_nor_stays_held() {
    let peers = start_peers(2);
    let rings = connect_all(&peers, 1, |cfg| cfg.timeout = Duration::from_secs(3));
    let len = 300_001;
    let run = |step: u64| {
        let inputs: Vec<_> = (0..2).map(|r| integer_input(r, len)).collect();
        let expected: Vec<f32> = inputs[0]
            .iter()
            .zip(&inputs[1])
            .map(|(a, b)| a + b)
            .collect();
        for (rank, out) in all_reduce(&peers, &rings, step, 0, inputs)
            .into_iter()
            .enumerate()
        {
            let out = out.unwrap_or_else(|e| panic!("step {step} rank {rank}: {e}"));
            assert!(out == expected, "step {step} rank {rank}: wrong sum");
        }
    };
    // Step 1 runs: rank 0 is now at step 1.
    run(1);

    // Rank 0 receives chunk 1 at ring step 0 (world 2): frames of an unknown bucket that keep
    // to that plan (64 KiB, aligned) could be real, so they are held, but apart from the ring.
    let huge: u64 = 1 << 26;
    let shaped = |step: u64, bucket: u32, count: u64| -> Vec<RingFrame> {
        (0..count)
            .map(|k| {
                let offset = huge / 2 + k * (FRAME_BYTES as u64 / 4);
                junk(step, bucket, huge, offset, FRAME_BYTES)
            })
            .collect()
    };
    // 4 MiB frames, which no all-reduce here plans: a bucket unknown at the current step, the
    // next step, and a step two ahead.
    let big = MAX_FRAME_BYTES;
    let big_len = (big / 4) as u64 * 16;
    let mut oversized = Vec::new();
    for (step, bucket) in [(1, 999), (2, 999), (3, 0), (3, 999), (2, 7)] {
        for k in 0..14u64 {
            oversized.push(junk(step, bucket, big_len, k * (big / 4) as u64, big));
        }
    }
    let phases = vec![shaped(2, 999, 160), oversized, shaped(1, 998, 64)];
    let addr = format!("http://{}", peers[0].addr);
    let codes = peers[0].rt.block_on(async move {
        let mut client = RingClient::connect(addr)
            .await
            .unwrap()
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let mut codes = Vec::new();
        for phase in phases {
            let mut phase_codes = Vec::new();
            for f in phase {
                // A push the mailbox holds back (no room left) ends the phase.
                match tokio::time::timeout(Duration::from_secs(2), client.push(f)).await {
                    Ok(r) => phase_codes.push(r.map(|_| Code::Ok).unwrap_or_else(|s| s.code())),
                    Err(_) => {
                        phase_codes.push(Code::DeadlineExceeded);
                        break;
                    }
                }
            }
            codes.push(phase_codes);
        }
        codes
    });

    // The ring goes on: step 2's all-reduce finds room and completes.
    run(2);

    // Plan-shaped frames were held; every 4 MiB frame and every frame two steps ahead refused.
    assert!(
        codes[0].len() == 160 && codes[0].iter().all(|c| *c == Code::Ok),
        "{:?}",
        codes[0]
    );
    assert!(
        codes[1].len() == 70 && codes[1].iter().all(|c| *c == Code::InvalidArgument),
        "{:?}",
        codes[1]
    );
    assert!(
        codes[2].len() == 64 && codes[2].iter().all(|c| *c == Code::Ok),
        "{:?}",
        codes[2]
    );
    assert_eq!(peers[0].mailbox.held_bytes(), (160 + 64) * FRAME_BYTES);

    // At step 3 nothing of step 1 can still come, at step 4 nothing of step 2.
    run(3);
    assert_eq!(peers[0].mailbox.held_bytes(), 160 * FRAME_BYTES);
    run(4);
    for (rank, p) in peers.iter().enumerate() {
        assert_eq!(p.mailbox.held_bytes(), 0, "rank {rank} still holds frames");
    }
}
