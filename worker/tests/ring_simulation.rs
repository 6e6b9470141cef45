//! Seeded, replayable simulations of the real ring code over the in-memory transport: each
//! seed draws a ring (2 to 48 ranks), a collective, a wire dtype, a few steps, a fault mix
//! (broken links, lost, duplicated, delayed and cut frames) and maybe a rank that dies, and runs
//! it on one thread with tokio's paused clock, so the schedule, the faults drawn and the virtual
//! time are fixed by the seed: a run replays exactly.
//!
//! Checked after every run: every rank ended (no hang: a bound on virtual time); every rank that
//! returned a result has the exact sums, bit-identical to every other's; a run whose faults lose
//! nothing (no lost or cut frame, no death) ends with every rank successful; every failure is
//! an all-reduce error; once every rank has ended and the network has delivered what it held,
//! no task (link, stream, timer) is left on the runtime, no mailbox of a ring that succeeded
//! holds a frame, and none holds one once it joined the next generation. Every
//! tenth seed is also run twice and must give the same outcome.
//!
//! `KEEL_SIM_SEEDS=N` (default 300) runs seeds `0..N`; `KEEL_SIM_FIRST=K` starts at `K`. A seed
//! that breaks an invariant is printed; add it to `REGRESSIONS` once fixed.

use std::sync::Arc;
use std::time::Duration;

use keel_worker::allreduce::{
    AllReduceError, Collective, LinkFaults, Mailbox, MemoryNetwork, Ring, RingConfig, WireDtype,
    owned_chunk,
};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Seeds that once broke an invariant, run on every test run.
const REGRESSIONS: &[u64] = &[285];

/// What one seed runs.
#[derive(Clone, Debug)]
struct Scenario {
    ranks: usize,
    len: usize,
    frame_bytes: usize,
    streams: usize,
    collective: Collective,
    dtype: WireDtype,
    steps: u64,
    faults: LinkFaults,
    /// A rank that dies, and after how much virtual time.
    kill: Option<(usize, Duration)>,
    timeout: Duration,
}

impl Scenario {
    fn draw(seed: u64) -> Scenario {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6b65_656c);
        let ranks = rng.random_range(2..=48usize);
        let collective = match rng.random_range(0..3) {
            0 => Collective::AllReduce,
            1 => Collective::ReduceScatter,
            _ => Collective::AllGather,
        };
        let dtype = if collective != Collective::AllGather && rng.random_bool(0.5) {
            WireDtype::Bf16
        } else {
            WireDtype::F32
        };
        // A third of the seeds run on a perfect network.
        let p = |rng: &mut ChaCha8Rng, max: f64| {
            if rng.random_bool(0.5) {
                rng.random::<f64>() * max
            } else {
                0.0
            }
        };
        let faulty = rng.random_range(0..3) != 0;
        let faults = if faulty {
            LinkFaults {
                fail: p(&mut rng, 0.1),
                lose: p(&mut rng, 0.002),
                duplicate: p(&mut rng, 0.1),
                delay: p(&mut rng, 0.3),
                max_delay: Duration::from_millis(rng.random_range(1..20)),
                truncate: p(&mut rng, 0.002),
            }
        } else {
            LinkFaults::default()
        };
        let kill = (faulty && rng.random_bool(0.15)).then(|| {
            (
                rng.random_range(0..ranks),
                Duration::from_millis(rng.random_range(0..200)),
            )
        });
        Scenario {
            ranks,
            len: ranks * rng.random_range(1..12) + rng.random_range(0..ranks),
            frame_bytes: 4 * rng.random_range(1..16),
            streams: rng.random_range(1..=3),
            collective,
            dtype,
            steps: rng.random_range(1..=3),
            faults,
            kill,
            timeout: Duration::from_secs(2),
        }
    }

    /// Whether nothing of the run can be lost: then every rank must succeed.
    fn lossless(&self) -> bool {
        self.faults.lose == 0.0 && self.faults.truncate == 0.0 && self.kill.is_none()
    }

    fn input(&self, r: usize, i: usize) -> f32 {
        match self.collective {
            Collective::AllGather if !owned_chunk(self.len, self.ranks, r).contains(&i) => {
                -1.0 - r as f32
            }
            Collective::AllGather => self.sum(i),
            _ => (r + i).is_multiple_of(4) as u8 as f32,
        }
    }

    fn sum(&self, i: usize) -> f32 {
        (0..self.ranks)
            .filter(|r| (r + i).is_multiple_of(4))
            .count() as f32
    }

    fn exact(&self, r: usize, out: &[f32]) -> bool {
        let own = owned_chunk(self.len, self.ranks, r);
        out.len() == self.len
            && (0..self.len).all(|i| {
                (self.collective == Collective::ReduceScatter && !own.contains(&i))
                    || out[i] == self.sum(i)
            })
    }
}

/// How one rank ended: its result's bits, an error's kind, or killed.
#[derive(Clone, Debug, PartialEq)]
enum End {
    Done(Vec<u32>),
    Failed(String),
    Killed,
}

/// What is left once every rank has ended and the network has had `REST` of virtual time to
/// deliver what it still held, in the mailboxes of the ranks that lived: the bytes of frames
/// held, then those held once each mailbox joined the job's next generation (as a worker does
/// for the next ring), and the tasks still alive on the runtime (links, streams, timers: the
/// in-memory network's connections).
#[derive(Clone, Debug, PartialEq)]
struct AtRest {
    held_bytes: usize,
    held_after_next_join: usize,
    alive_tasks: usize,
}

/// Virtual time given to the network after the last rank ended, before [`AtRest`] is read:
/// longer than any injected delay and than the ring's timeout.
const REST: Duration = Duration::from_secs(30);

/// Runs `s` on one thread with a paused clock; each rank's end, the virtual time taken, and
/// what was left at rest.
fn run(s: &Scenario, seed: u64) -> (Vec<End>, Duration, AtRest) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let start = tokio::time::Instant::now();
        let net = MemoryNetwork::new(seed);
        let peers: Vec<String> = (0..s.ranks).map(|r| format!("rank-{r}:7071")).collect();
        let (mut tasks, mut mailboxes) = (Vec::new(), Vec::new());
        for r in 0..s.ranks {
            let mailbox = Mailbox::new();
            net.attach(&peers[r], Arc::clone(&mailbox));
            mailboxes.push(Arc::clone(&mailbox));
            let cfg = RingConfig {
                job_id: "job-1".into(),
                generation: 1,
                rank: r as u32,
                world_size: s.ranks as u32,
                peers: peers.clone(),
                streams_per_link: s.streams,
                frame_bytes: s.frame_bytes,
                timeout: s.timeout,
            };
            let data: Vec<f32> = (0..s.len).map(|i| s.input(r, i)).collect();
            let (net, s) = (net.clone(), s.clone());
            tasks.push(tokio::spawn(async move {
                let ring = Ring::connect_over(cfg, mailbox, &net).await?;
                let mut out = Vec::new();
                for step in 1..=s.steps {
                    out = ring
                        .collective(step, 0, data.clone(), s.dtype, s.collective)
                        .await?;
                }
                Ok::<_, AllReduceError>(out)
            }));
        }
        net.set_faults(s.faults);
        if let Some((victim, after)) = s.kill {
            tokio::time::sleep(after).await;
            tasks[victim].abort();
            net.detach(&peers[victim]);
        }
        let mut ends = Vec::new();
        for t in tasks {
            // Virtual time: a hang would run the clock past the bound, not the test's wall time.
            let end = match tokio::time::timeout(Duration::from_secs(600), t).await {
                Err(_) => End::Failed("HANG".into()),
                Ok(Err(_)) => End::Killed,
                Ok(Ok(Ok(out))) => End::Done(out.iter().map(|x| x.to_bits()).collect()),
                Ok(Ok(Err(e))) => End::Failed(kind(&e)),
            };
            ends.push(end);
        }
        let took = start.elapsed();
        tokio::time::sleep(REST).await;
        let lived: Vec<(usize, Arc<Mailbox>)> = mailboxes
            .into_iter()
            .enumerate()
            .filter(|(r, _)| s.kill.is_none_or(|(v, _)| v != *r))
            .collect();
        let held_bytes = lived.iter().map(|(_, m)| m.held_bytes()).sum();
        // The next generation, on a ring of one (joining is what releases the old frames).
        for (r, m) in &lived {
            let cfg = RingConfig {
                job_id: "job-1".into(),
                generation: 2,
                rank: 0,
                world_size: 1,
                peers: vec![peers[*r].clone()],
                streams_per_link: 1,
                frame_bytes: s.frame_bytes,
                timeout: s.timeout,
            };
            if let Err(e) = Ring::connect_over(cfg, Arc::clone(m), &net).await {
                panic!("rank {r} could not join generation 2: {e}");
            }
        }
        let rest = AtRest {
            held_bytes,
            held_after_next_join: lived.iter().map(|(_, m)| m.held_bytes()).sum(),
            alive_tasks: tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks(),
        };
        (ends, took, rest)
    })
}

/// The error's kind (its variant), as a seed's outcome names it.
fn kind(e: &AllReduceError) -> String {
    let debug = format!("{e:?}");
    debug
        .split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or("")
        .to_string()
}

/// The invariants a run must hold; `Err` names the one broken.
fn check(s: &Scenario, ends: &[End], took: Duration, rest: &AtRest) -> Result<(), String> {
    // Memory and connections back at their baseline: a finished ring holds no frame and
    // leaves no task behind (a leak here grows with every step of a long job).
    // A ring whose every living rank succeeded consumed every frame it was sent; a failed one
    // may hold frames of its last step until the worker joins its next generation.
    let all_done = ends.iter().all(|e| matches!(e, End::Done(_) | End::Killed));
    if all_done && rest.held_bytes != 0 {
        return Err(format!(
            "{} bytes of frames still held {REST:?} after every rank succeeded",
            rest.held_bytes
        ));
    }
    if rest.held_after_next_join != 0 {
        return Err(format!(
            "{} bytes of frames still held after each mailbox joined the next generation",
            rest.held_after_next_join
        ));
    }
    if rest.alive_tasks != 0 {
        return Err(format!(
            "{} tasks still alive {REST:?} after every rank ended",
            rest.alive_tasks
        ));
    }
    let mut first: Option<&Vec<u32>> = None;
    for (r, end) in ends.iter().enumerate() {
        match end {
            End::Done(bits) => {
                let out: Vec<f32> = bits.iter().map(|b| f32::from_bits(*b)).collect();
                if !s.exact(r, &out) {
                    return Err(format!("rank {r} returned a wrong result"));
                }
                if s.collective != Collective::ReduceScatter && *first.get_or_insert(bits) != bits {
                    return Err(format!("rank {r}'s result differs from another rank's"));
                }
            }
            End::Failed(k) if k == "HANG" => return Err(format!("rank {r} hung")),
            End::Failed(k) if s.lossless() => {
                return Err(format!(
                    "rank {r} failed ({k}) on a network that loses nothing"
                ));
            }
            End::Failed(_) => {}
            End::Killed if s.kill.is_some_and(|(v, _)| v == r) => {}
            End::Killed => return Err(format!("rank {r} ended without an outcome")),
        }
    }
    // Each rank gives up after at most a few timeouts without progress, on top of the work.
    if took > s.timeout * 20 {
        return Err(format!("took {took:?} of virtual time"));
    }
    Ok(())
}

#[test]
fn seeded_ring_simulations_hold_every_invariant_and_replay_exactly() {
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let first = env("KEEL_SIM_FIRST", 0);
    let count = env("KEEL_SIM_SEEDS", 300);
    let seeds: Vec<u64> = REGRESSIONS
        .iter()
        .copied()
        .chain(first..first + count)
        .collect();
    let started = std::time::Instant::now();
    let (mut failed_runs, mut faulty, mut killed, mut broken) = (0, 0, 0, Vec::new());
    for &seed in &seeds {
        let s = Scenario::draw(seed);
        let (ends, took, rest) = run(&s, seed);
        if let Err(why) = check(&s, &ends, took, &rest) {
            broken.push(format!("seed {seed}: {why}\n  {s:?}"));
            continue;
        }
        // Every 10th seed is replayed: the same seed, the same ends, the same virtual time.
        if seed % 10 == 0 {
            let again = run(&s, seed);
            if again != (ends.clone(), took, rest) {
                broken.push(format!("seed {seed}: the replay differs\n  {s:?}"));
            }
        }
        faulty += usize::from(!s.lossless() || s.faults != LinkFaults::default());
        killed += usize::from(s.kill.is_some());
        failed_runs += usize::from(ends.iter().any(|e| matches!(e, End::Failed(_))));
    }
    println!(
        "{} seeds ({first}..{}) in {:.1} s: {faulty} with faults, {killed} with a rank killed, \
         {failed_runs} ended in all-reduce errors, {} broke an invariant",
        seeds.len(),
        first + count,
        started.elapsed().as_secs_f64(),
        broken.len()
    );
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}
