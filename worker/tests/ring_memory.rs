//! The real ring code (all-reduce, reduce-scatter, all-gather; f32 and bf16 wire) on 64 and
//! 512 ranks in one process, over the in-memory transport: sums exact on integer inputs, every
//! rank's result bit-identical; and under injected faults (links that break, frames lost,
//! duplicated, held back and overtaken, cut short; a rank that dies mid-collective) every rank
//! ends, either with the exact result or with an all-reduce error, never a hang.

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_worker::allreduce::{
    AllReduceError, Collective, FaultCounts, LinkFaults, Mailbox, MemoryNetwork, Ring, RingConfig,
    WireDtype, owned_chunk,
};

/// The longest any run here may take before it counts as a hang.
const HANG: Duration = Duration::from_secs(120);

/// Rank `r`'s input at element `i`: 1 where `(r + i) % 4 == 0`, else 0; every partial sum of
/// up to 1,024 ranks is at most 256, exact in bf16 as in f32.
fn input(rank: usize, i: usize) -> f32 {
    (rank + i).is_multiple_of(4) as u8 as f32
}

/// The sum over `n` ranks of [`input`] at `i`.
fn sum(n: usize, i: usize) -> f32 {
    (0..n).filter(|r| (r + i).is_multiple_of(4)).count() as f32
}

/// Each rank's outcome: its result, its error, or nothing (a rank that was killed).
type Outcomes = Vec<Option<Result<Vec<f32>, AllReduceError>>>;

fn addr(rank: usize) -> String {
    format!("10.{}.{}.1:7071", rank / 250, rank % 250)
}

/// What one ring run does.
#[derive(Clone, Copy)]
struct Run {
    ranks: usize,
    len: usize,
    dtype: WireDtype,
    collective: Collective,
    /// Steps run one after another (frames of step s + 1 may arrive before step s ends).
    steps: u64,
    faults: LinkFaults,
    /// Per-frame timeout of the ring.
    timeout: Duration,
    seed: u64,
    /// A rank that dies (its task dropped, its address gone) this long into the run.
    kill: Option<(usize, Duration)>,
}

impl Run {
    fn new(ranks: usize, collective: Collective, dtype: WireDtype) -> Run {
        Run {
            ranks,
            // Eight elements a chunk: one 32-byte frame per chunk per ring step.
            len: ranks * 8,
            dtype,
            collective,
            steps: 2,
            faults: LinkFaults::default(),
            timeout: Duration::from_secs(20),
            seed: 1,
            kill: None,
        }
    }

    /// Rank `r`'s buffer: the input, or for an all-gather the input in its own chunk only.
    fn data(&self, r: usize) -> Vec<f32> {
        let own = owned_chunk(self.len, self.ranks, r);
        (0..self.len)
            .map(|i| match self.collective {
                Collective::AllGather if !own.contains(&i) => -1.0 - r as f32,
                Collective::AllGather => sum(self.ranks, i),
                _ => input(r, i),
            })
            .collect()
    }

    /// Whether `out` is rank `r`'s exact result.
    fn exact(&self, r: usize, out: &[f32]) -> bool {
        let own = owned_chunk(self.len, self.ranks, r);
        out.len() == self.len
            && (0..self.len).all(|i| match self.collective {
                Collective::ReduceScatter if !own.contains(&i) => true,
                _ => out[i] == sum(self.ranks, i),
            })
    }

    /// Runs every rank; each rank's outcome (of its last step, or its first failure), and how
    /// long the whole run took.
    fn go(&self) -> (Outcomes, Duration) {
        let (outcomes, took, _) = self.go_counting();
        (outcomes, took)
    }

    /// [`Run::go`], and the faults the network injected.
    fn go_counting(&self) -> (Outcomes, Duration, FaultCounts) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let net = MemoryNetwork::new(self.seed);
        let peers: Vec<String> = (0..self.ranks).map(addr).collect();
        let mailboxes: Vec<Arc<Mailbox>> = (0..self.ranks).map(|_| Mailbox::new()).collect();
        for (a, m) in peers.iter().zip(&mailboxes) {
            net.attach(a, Arc::clone(m));
        }
        net.set_faults(self.faults);
        let started = Instant::now();
        let run = *self;
        let outcomes = rt.block_on(async {
            let mut tasks = Vec::new();
            for (r, mailbox) in mailboxes.iter().enumerate() {
                let cfg = RingConfig {
                    job_id: "job-1".into(),
                    generation: 1,
                    rank: r as u32,
                    world_size: run.ranks as u32,
                    peers: peers.clone(),
                    streams_per_link: 2,
                    frame_bytes: 32,
                    timeout: run.timeout,
                };
                let (net, mailbox, data) = (net.clone(), Arc::clone(mailbox), run.data(r));
                tasks.push(tokio::spawn(async move {
                    let ring = Ring::connect_over(cfg, mailbox, &net).await?;
                    let mut out = Vec::new();
                    for step in 1..=run.steps {
                        out = ring
                            .collective(step, 0, data.clone(), run.dtype, run.collective)
                            .await?;
                    }
                    Ok(out)
                }));
            }
            if let Some((victim, after)) = run.kill {
                tokio::time::sleep(after).await;
                tasks[victim].abort();
                net.detach(&peers[victim]);
            }
            let all = futures::future::join_all(tasks);
            let joined = tokio::time::timeout(HANG, all)
                .await
                .expect("a rank hung: the ring never ended");
            joined
                .into_iter()
                .map(|j| j.ok()) // an aborted task has no outcome
                .collect::<Vec<_>>()
        });
        (outcomes, started.elapsed(), net.injected())
    }
}

/// Every rank succeeded with the exact result, all-reduce and all-gather results bit-identical
/// across ranks.
fn assert_all_exact(run: &Run, outcomes: &[Option<Result<Vec<f32>, AllReduceError>>]) {
    let mut first: Option<&Vec<f32>> = None;
    for (r, o) in outcomes.iter().enumerate() {
        let out = match o {
            Some(Ok(out)) => out,
            Some(Err(e)) => panic!("rank {r} failed: {e}"),
            None => panic!("rank {r} has no outcome"),
        };
        assert!(run.exact(r, out), "rank {r}: wrong result");
        if run.collective != Collective::ReduceScatter {
            let same = first.get_or_insert(out);
            assert!(
                same.iter()
                    .zip(out)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {r} differs from rank 0"
            );
        }
    }
}

#[test]
fn every_collective_is_exact_and_identical_on_64_and_512_ranks() {
    for ranks in [64, 512] {
        for collective in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
        ] {
            let dtypes: &[WireDtype] = match collective {
                // Weights travel in f32 only.
                Collective::AllGather => &[WireDtype::F32],
                _ => &[WireDtype::F32, WireDtype::Bf16],
            };
            for &dtype in dtypes {
                let run = Run::new(ranks, collective, dtype);
                let (outcomes, took) = run.go();
                assert_all_exact(&run, &outcomes);
                eprintln!(
                    "{ranks} ranks, {collective:?} {dtype:?}: {} steps in {:.2} s",
                    run.steps,
                    took.as_secs_f64()
                );
            }
        }
    }
}

#[test]
fn faults_that_lose_nothing_leave_every_sum_exact() {
    // Links that break (the sender retries), copies refused as duplicates, frames held back
    // and overtaken: nothing is lost, so every rank must end with the exact sums.
    for (seed, dtype) in [(7, WireDtype::F32), (8, WireDtype::Bf16)] {
        let mut run = Run::new(64, Collective::AllReduce, dtype);
        run.seed = seed;
        run.steps = 3;
        run.faults = LinkFaults {
            fail: 0.05,
            duplicate: 0.05,
            delay: 0.2,
            max_delay: Duration::from_millis(3),
            ..LinkFaults::default()
        };
        let (outcomes, _, injected) = run.go_counting();
        assert_all_exact(&run, &outcomes);
        eprintln!("{dtype:?}: {injected:?}");
        assert!(
            injected.failed > 0 && injected.duplicated > 0 && injected.delayed > 0,
            "{injected:?}"
        );
    }
}

/// Every rank ended (no hang) within the bound; every success is exact; at least one rank
/// failed with an all-reduce error; the failures are those `expected` accepts.
fn assert_fails_cleanly(
    what: &str,
    run: &Run,
    outcomes: &[Option<Result<Vec<f32>, AllReduceError>>],
    took: Duration,
    expected: impl Fn(&AllReduceError) -> bool,
) {
    let mut failed = 0;
    for (r, o) in outcomes.iter().enumerate() {
        match o {
            Some(Ok(out)) => assert!(run.exact(r, out), "{what}: rank {r} returned a wrong sum"),
            Some(Err(e)) => {
                failed += 1;
                assert!(expected(e), "{what}: rank {r} failed with {e}");
                assert!(
                    e.is_retryable() || matches!(e, AllReduceError::Transport { .. }),
                    "{e}"
                );
            }
            None => {}
        }
    }
    assert!(failed > 0, "{what}: no rank noticed the fault");
    // Each rank gives up after at most a few timeouts without progress.
    assert!(
        took < run.timeout * 6,
        "{what}: took {:.1} s with a {:?} timeout",
        took.as_secs_f64(),
        run.timeout
    );
    eprintln!(
        "{what}: {failed} of {} ranks failed, all within {:.1} s",
        run.ranks,
        took.as_secs_f64()
    );
}

#[test]
fn a_frame_lost_after_its_ack_ends_in_timeouts_not_a_hang() {
    let mut run = Run::new(64, Collective::AllReduce, WireDtype::F32);
    run.timeout = Duration::from_secs(2);
    run.faults = LinkFaults {
        lose: 0.001,
        ..LinkFaults::default()
    };
    run.seed = 3;
    let (outcomes, took) = run.go();
    assert_fails_cleanly("lost frames", &run, &outcomes, took, |e| {
        matches!(e, AllReduceError::Timeout { .. })
    });
}

#[test]
fn a_frame_cut_short_is_refused_and_the_ring_fails_cleanly() {
    for dtype in [WireDtype::F32, WireDtype::Bf16] {
        let mut run = Run::new(64, Collective::AllReduce, dtype);
        run.timeout = Duration::from_secs(2);
        run.faults = LinkFaults {
            truncate: 0.002,
            ..LinkFaults::default()
        };
        run.seed = 4;
        let (outcomes, took) = run.go();
        assert_fails_cleanly("cut frames", &run, &outcomes, took, |e| {
            // The sender hears INVALID_ARGUMENT; the others time out waiting.
            matches!(
                e,
                AllReduceError::Transport {
                    code: tonic::Code::InvalidArgument,
                    ..
                } | AllReduceError::Timeout { .. }
            )
        });
    }
}

#[test]
fn a_rank_that_dies_mid_collective_fails_its_neighbours_in_bounded_time() {
    let mut run = Run::new(64, Collective::AllReduce, WireDtype::F32);
    run.timeout = Duration::from_secs(2);
    run.steps = 200;
    run.kill = Some((17, Duration::from_millis(150)));
    let (outcomes, took) = run.go();
    assert!(outcomes[17].is_none(), "the killed rank has no outcome");
    assert_fails_cleanly("a dead rank", &run, &outcomes, took, |e| {
        matches!(
            e,
            AllReduceError::Timeout { .. } | AllReduceError::PeerUnreachable { .. }
        )
    });
}
