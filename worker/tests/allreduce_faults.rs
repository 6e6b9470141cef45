//! Failure handling of the ring over real tonic servers on 127.0.0.1: a dead peer ends the
//! all-reduce with an error naming it (no hang), stale generations, other jobs and malformed
//! frames are refused with the documented gRPC codes.

mod allreduce_support;

use std::sync::Arc;
use std::time::Duration;

use allreduce_support::{config, connect_all, start_peers};
use bytes::Bytes;
use keel_proto::ring_rpc::RingFrame;
use keel_proto::ring_rpc::ring_client::RingClient;
use keel_worker::allreduce::{AllReduceError, MAX_MESSAGE_BYTES, Ring};
use tonic::Code;

#[test]
fn a_dead_peer_fails_the_all_reduce_naming_it() {
    let mut peers = start_peers(3);
    let timeout = Duration::from_secs(2);
    let rings = connect_all(&peers, 1, |cfg| cfg.timeout = timeout);
    let dead_addr = peers[2].addr.clone();
    // Ranks 0 and 1 start; rank 2 never calls and then dies with its server.
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let ring = rings[rank].clone();
            peers[rank].rt.spawn(async move {
                let data = vec![1.0f32; 2_000_003];
                let started = tokio::time::Instant::now();
                let result = ring.all_reduce_sum(1, 0, data).await;
                (result, started.elapsed())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    peers.pop().unwrap().rt.shutdown_background();
    let results: Vec<_> = handles
        .into_iter()
        .zip(&peers)
        .map(|(h, p)| p.rt.block_on(h).unwrap())
        .collect();
    // Rank 0 waits on its left neighbour, rank 2: the error names rank 2 and its address.
    let (result0, _) = &results[0];
    match result0 {
        Err(e @ AllReduceError::Timeout { rank: 2, addr, .. }) => {
            assert_eq!(*addr, dead_addr);
            assert!(e.to_string().contains(&dead_addr) && e.to_string().contains("rank 2"));
            assert!(e.is_retryable());
        }
        other => panic!("rank 0: expected a timeout naming rank 2, got {other:?}"),
    }
    for (rank, (result, waited)) in results.iter().enumerate() {
        assert!(result.is_err(), "rank {rank} must fail");
        // Bounded: well within a few timeouts (no hang), not a speed assertion.
        assert!(*waited < timeout * 5, "rank {rank} took {waited:?}");
    }
}

#[test]
fn an_unreachable_right_neighbour_is_named_at_connect() {
    // Bind then drop a listener: nothing serves that port any more.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let peers = start_peers(1);
    let mut cfg = config(&peers, 0, 1);
    cfg.world_size = 2;
    cfg.peers.push(closed.clone());
    cfg.timeout = Duration::from_millis(500);
    let err = peers[0]
        .rt
        .block_on(Ring::connect(cfg, Arc::clone(&peers[0].mailbox)))
        .err()
        .expect("connect must fail");
    match &err {
        AllReduceError::PeerUnreachable { rank: 1, addr, .. } => assert_eq!(*addr, closed),
        other => panic!("expected PeerUnreachable naming rank 1, got {other:?}"),
    }
    assert!(err.to_string().contains(&closed));
}

fn frame(job: &str, generation: u64, data: Bytes, total_len: u64, offset: u64) -> RingFrame {
    RingFrame {
        job_id: job.to_string(),
        generation,
        step: 1,
        bucket: 0,
        sender_rank: 1,
        ring_step: 0,
        total_len,
        offset,
        data,
        dtype: 0,
        collective: 0,
    }
}

#[test]
fn frames_of_stale_generations_other_jobs_or_bad_shape_are_refused() {
    let peers = start_peers(2);
    let _rings = connect_all(&peers, 5, |_| {});
    let addr = format!("http://{}", peers[0].addr);
    let codes = peers[0].rt.block_on(async move {
        let mut client = RingClient::connect(addr)
            .await
            .unwrap()
            .max_encoding_message_size(2 * MAX_MESSAGE_BYTES);
        let four = Bytes::from(vec![0u8; 16]);
        let mut codes = Vec::new();
        for f in [
            frame("job-test", 4, four.clone(), 4, 0), // stale generation
            frame("other-job", 5, four.clone(), 4, 0), // another job
            frame("job-test", 6, four.clone(), 4, 0), // not joined yet
            frame("job-test", 5, Bytes::from(vec![0u8; 7]), 4, 0), // not whole f32s
            frame("job-test", 5, four.clone(), 4, 2), // past the end
            frame("job-test", 5, four.clone(), 4, u64::MAX), // offset overflow
            frame("job-test", 5, Bytes::new(), 4, 0), // empty
            frame(
                "job-test",
                5,
                Bytes::from(vec![0u8; (4 << 20) + 4]),
                1 << 21,
                0,
            ), // oversized
            frame("job-test", 5, Bytes::from(vec![0u8; 8 << 20]), 1 << 22, 0), // over the message limit
        ] {
            codes.push(client.push(f).await.map(|_| ()).map_err(|s| s.code()));
        }
        codes
    });
    assert_eq!(
        codes,
        vec![
            Err(Code::FailedPrecondition),
            Err(Code::NotFound),
            Err(Code::Unavailable),
            Err(Code::InvalidArgument),
            Err(Code::InvalidArgument),
            Err(Code::InvalidArgument),
            Err(Code::InvalidArgument),
            Err(Code::InvalidArgument),
            Err(Code::OutOfRange),
        ]
    );
    // The server survived all of that and still holds nothing.
    assert_eq!(peers[0].mailbox.held_bytes(), 0);
}

#[test]
fn a_ring_of_an_older_generation_fails_with_stale_generation() {
    let peers = start_peers(2);
    let old = connect_all(&peers, 1, |_| {});
    // Rank 1 moves on to generation 2; rank 0 still reduces with generation 1.
    let _newer = peers[1]
        .rt
        .block_on(Ring::connect(
            config(&peers, 1, 2),
            Arc::clone(&peers[1].mailbox),
        ))
        .unwrap();
    let ring0 = old[0].clone();
    let err = peers[0]
        .rt
        .block_on(async move {
            let data = vec![1.0f32; 1000];
            ring0.all_reduce_sum(3, 0, data).await
        })
        .expect_err("stale ring must fail");
    assert!(
        matches!(err, AllReduceError::StaleGeneration { ours: 1, .. }),
        "{err:?}"
    );
    // Joining an older generation than the mailbox serves is refused as well.
    let err = peers[1]
        .rt
        .block_on(Ring::connect(
            config(&peers, 1, 1),
            Arc::clone(&peers[1].mailbox),
        ))
        .err()
        .expect("older generation must be refused");
    assert!(
        matches!(err, AllReduceError::StaleGeneration { .. }),
        "{err:?}"
    );
    // The old ring of rank 1 sees its generation gone too.
    let ring1 = old[1].clone();
    let err = peers[1]
        .rt
        .block_on(async move {
            let data = vec![1.0f32; 1000];
            ring1.all_reduce_sum(3, 0, data).await
        })
        .expect_err("stale ring must fail");
    assert!(
        matches!(err, AllReduceError::StaleGeneration { .. }),
        "{err:?}"
    );
}

#[test]
fn mismatched_lengths_are_reported_not_hung() {
    let peers = start_peers(2);
    let rings = connect_all(&peers, 1, |cfg| cfg.timeout = Duration::from_secs(3));
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let ring = rings[rank].clone();
            peers[rank].rt.spawn(async move {
                let data = vec![1.0f32; 1000 + rank];
                ring.all_reduce_sum(1, 0, data).await
            })
        })
        .collect();
    let results: Vec<_> = handles
        .into_iter()
        .zip(&peers)
        .map(|(h, p)| p.rt.block_on(h).unwrap())
        .collect();
    let mismatch = results.iter().any(|r| {
        matches!(r, Err(AllReduceError::LengthMismatch { .. }))
            || matches!(
                r,
                Err(AllReduceError::Transport {
                    code: Code::InvalidArgument,
                    ..
                })
            )
    });
    assert!(mismatch, "{results:?}");
    assert!(results.iter().all(|r| r.is_err()));
}

#[test]
fn the_stream_acks_each_frame_with_its_code_and_stays_open() {
    let peers = start_peers(2);
    let _rings = connect_all(&peers, 5, |_| {});
    let addr = format!("http://{}", peers[0].addr);
    let codes = peers[0].rt.block_on(async move {
        let mut client = RingClient::connect(addr).await.unwrap();
        let four = Bytes::from(vec![0u8; 16]);
        let frames = vec![
            frame("job-test", 4, four.clone(), 4, 0), // stale generation
            frame("other-job", 5, four.clone(), 4, 0), // another job
            frame("job-test", 5, Bytes::from(vec![0u8; 7]), 4, 0), // not whole f32s
            // Fine: rank 0 of 2 receives chunk 1 (elements 2..4) at ring step 0; buffered.
            frame("job-test", 5, Bytes::from(vec![0u8; 8]), 4, 2),
        ];
        let mut acks = client
            .stream(futures::stream::iter(frames))
            .await
            .unwrap()
            .into_inner();
        let mut codes = Vec::new();
        while let Some(ack) = acks.message().await.unwrap() {
            codes.push(Code::from_i32(ack.code as i32));
        }
        codes
    });
    assert_eq!(
        codes,
        vec![
            Code::FailedPrecondition,
            Code::NotFound,
            Code::InvalidArgument,
            Code::Ok
        ]
    );
    // The accepted frame waits in the mailbox for its all-reduce.
    assert_eq!(peers[0].mailbox.held_bytes(), 8);
}
