//! The simulator's core: the seeded random source, the virtual clock and event queue, the
//! network, the fault schedule and the run loop. The coordinator's side (the real `Machine`
//! and a model of its driver) is in `coord`, the workers and their rings in `worker`, the
//! invariants and the summary in `check`.

pub mod check;
mod coord;
mod events;
mod ring;
mod worker;

use keel_coordinator::machine::Machine;
use keel_coordinator::persist::JobRecord;
use keel_proto::jobspec::JobSpec;
use keel_proto::rpc::{
    DoneReport, EvalReport, FailureReport, HeldReport, StepReport, TrainingKey, worker_command,
};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use check::{Report, Summary};
use events::{Answer, Call, DriverInput, Ev, Heal, Up};
use worker::{Ring, Worker};

/// A small self-contained PRNG (SplitMix64): one `u64` seed gives the whole run, and the
/// stream is the same on every platform and toolchain.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5DEE_CE66_D1CE_5EED)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// SplitMix64's finaliser: the hash the stand-in training is built from.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The stand-in for one optimiser step: `w_{s+1} = H(w_s, step, global batch id, world)`.
/// The world size is in it because a real all-reduce sums in an order that depends on it,
/// so only a run that kept its world size must end bit-identical to an uninterrupted one.
pub fn train_step(w: u64, step: u64, global_batch: u64, world: u64) -> u64 {
    let batch_id = mix(step.wrapping_mul(0x1000_0000_01B3) ^ global_batch);
    mix(w ^ mix(step ^ mix(batch_id ^ mix(world))))
}

/// A job's initial weights (the same on every rank: seeded by the job).
pub fn init_weights(job_id: &str) -> u64 {
    job_id.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x1000_0000_01B3)
    })
}

/// The weights an uninterrupted run of `max_steps` on `world` ranks ends with.
pub fn uninterrupted(job_id: &str, max_steps: u64, global_batch: u64, world: u64) -> u64 {
    (1..=max_steps).fold(init_weights(job_id), |w, s| {
        train_step(w, s, global_batch, world)
    })
}

/// The kinds of fault the schedule draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    /// A worker process dies (memory lost, cache kept) and starts again later.
    WorkerCrash,
    /// The coordinator dies and starts again from the records saved so far.
    CoordinatorCrash,
    /// A worker is cut from the coordinator (both ways) until healed.
    CoordinatorPartition,
    /// A worker is cut from its ring peers until healed.
    RingPartition,
    /// A worker computes slowly for a while.
    Stall,
    /// Checkpoint writes in the coordinator's data folder fail for a while.
    CheckpointStoreOutage,
    /// Job record writes fail for a while.
    RecordWriteOutage,
}

/// What one run simulates.
#[derive(Debug, Clone)]
pub struct Config {
    /// The seed of everything.
    pub seed: u64,
    /// Simulated worker processes.
    pub workers: usize,
    /// Faults are drawn in `0..fault_window_ms` of virtual time; afterwards everything heals.
    pub fault_window_ms: u64,
    /// Every job must have ended by then (virtual milliseconds).
    pub deadline_ms: u64,
    /// The most events one run may take (a bound on every loop).
    pub max_events: u64,
    /// Print the run's main events to stderr (`KEEL_SIM_TRACE=1`), to study one seed.
    pub trace: bool,
}

impl Config {
    /// The settings the suite and the long runs use for `seed` on `workers` workers.
    pub fn new(seed: u64, workers: usize) -> Self {
        Config {
            seed,
            workers,
            fault_window_ms: 60_000,
            deadline_ms: 900_000,
            max_events: 3_000_000,
            trace: std::env::var_os("KEEL_SIM_TRACE").is_some(),
        }
    }
}

/// The simulated network's state and its randomness.
#[derive(Debug, Default)]
struct Net {
    /// Worker `i` cannot reach the coordinator (nor it the worker).
    coord_cut: Vec<bool>,
    /// Worker `i` cannot reach its ring peers.
    ring_cut: Vec<bool>,
    /// Largest one-way latency, milliseconds.
    jitter_ms: u64,
    /// Chance that one RPC is lost (it fails at the caller).
    drop_p: f64,
    /// When the last message of each (worker, channel) arrives: one connection is FIFO.
    last: HashMap<(usize, bool), u64>,
}

/// The coordinator process: the real machine (absent while crashed) and what its driver keeps.
#[derive(Debug, Default)]
struct Coordinator {
    /// The real machine; `None` while the process is down.
    machine: Option<Machine>,
    /// Bumped at every crash: effects' results and RPCs of an older process are dropped.
    epoch: u64,
    /// The attach stream counter of the driver.
    attach: u64,
    /// The job records as the effects saved them (what a restart reads back).
    records: BTreeMap<String, JobRecord>,
    /// Each submitted job's spec and folder (its `job.toml`).
    specs: BTreeMap<String, JobSpec>,
    /// Jobs whose data folder is complete (a restart gives them their prepared data back).
    data_ready: BTreeSet<String>,
    /// Preparations asked for and not yet answered (a crash interrupts them).
    preparing: BTreeSet<String>,
    /// Interrupted preparations per job.
    interrupted: BTreeMap<String, u32>,
    /// Checkpoint writes fail until then.
    store_outage_until: u64,
    /// Record writes fail until then.
    record_outage_until: u64,
}

/// One whole simulated cluster.
pub struct Sim {
    /// What is simulated.
    cfg: Config,
    /// The run's one source of randomness.
    rng: Rng,
    /// Virtual milliseconds since the start.
    now: u64,
    /// Events scheduled so far: the tie-breaker of equal times.
    seq: u64,
    /// Pending events by (time, sequence number).
    queue: BTreeMap<(u64, u64), Ev>,
    /// The machine's clock at virtual time 0 (every `Instant` it sees is this plus `now`).
    t0: Instant,
    /// The coordinator process.
    coord: Coordinator,
    /// The network.
    net: Net,
    /// The worker processes.
    workers: Vec<Worker>,
    /// Worker ids of live sessions → simulated worker.
    ids: HashMap<String, usize>,
    /// Every ring formed so far.
    rings: Vec<Ring>,
    /// Rings by (job, generation, coordinator epoch).
    ring_index: HashMap<(String, u64, u64), usize>,
    /// The checkpoint store: `(job, step)` → weights.
    store: BTreeMap<(String, u64), u64>,
    /// Checkpoints removed from the store by `RemoveCheckpoints`.
    pruned: HashSet<(String, u64)>,
    /// Every `(job, step, weights)` some rank reached.
    reached: HashSet<(String, u64, u64)>,
    /// World sizes each job's generations ran with, and its global batch.
    worlds: BTreeMap<String, (BTreeSet<u32>, u64)>,
    /// The coordinator process (epoch) that launched each `(job, generation)`.
    launched_by: HashMap<(String, u64), u64>,
    /// Job specs to submit, and the ids they got.
    to_submit: Vec<JobSpec>,
    /// The id each job got, once its submission was answered as accepted.
    submitted: Vec<Option<String>>,
    /// A submission whose answer never came (the coordinator died while it waited): the
    /// user looks for it before submitting again.
    in_doubt: Vec<Option<String>>,
    /// Runs started so far (each worker run's serial number).
    run_serial: u64,
    /// The fault window has closed.
    faults_over: bool,
    /// When every job was first seen ended after the fault window (the run stops 20 s later).
    all_done_at: Option<u64>,
    /// What the run found.
    report: Report,
}

impl Sim {
    /// A cluster for `cfg`: workers, jobs, network settings and the fault schedule, all from
    /// its seed.
    pub fn new(cfg: Config) -> Self {
        let mut rng = Rng::new(cfg.seed);
        let n = cfg.workers;
        let jitter_ms = [5, 30, 200][rng.range(0, 2) as usize];
        let drop_p = [0.0, 0.002, 0.01][rng.range(0, 2) as usize];
        let to_submit = coord::job_specs(&mut rng, n);
        let mut sim = Sim {
            rng,
            now: 0,
            seq: 0,
            queue: BTreeMap::new(),
            t0: Instant::now(),
            coord: Coordinator {
                machine: Some(Machine::new(coord::jobs_dir())),
                ..Default::default()
            },
            net: Net {
                coord_cut: vec![false; n],
                ring_cut: vec![false; n],
                jitter_ms,
                drop_p,
                last: HashMap::new(),
            },
            workers: (0..n).map(Worker::new).collect(),
            ids: HashMap::new(),
            rings: Vec::new(),
            ring_index: HashMap::new(),
            store: BTreeMap::new(),
            pruned: HashSet::new(),
            reached: HashSet::new(),
            worlds: BTreeMap::new(),
            launched_by: HashMap::new(),
            submitted: vec![None; to_submit.len()],
            in_doubt: vec![None; to_submit.len()],
            to_submit,
            run_serial: 0,
            faults_over: false,
            all_done_at: None,
            report: Report {
                seed: cfg.seed,
                workers: n,
                ..Default::default()
            },
            cfg,
        };
        sim.schedule_start();
        sim
    }

    /// Workers start, jobs are submitted, faults are drawn.
    fn schedule_start(&mut self) {
        for w in 0..self.workers.len() {
            let at = self.rng.range(0, 1000);
            self.at(at, Ev::Register { w, inc: 0 });
            let hb = self.rng.range(1000, 2000);
            self.at(hb, Ev::Heartbeat { w, inc: 0 });
        }
        self.at(0, Ev::Tick { epoch: 0 });
        for job in 0..self.to_submit.len() {
            let at = self.rng.range(1500, 4000);
            self.at(at, Ev::Submit { job });
        }
        let faults = self.rng.range(0, 14);
        for _ in 0..faults {
            let kind = match self.rng.range(0, 99) {
                0..=29 => FaultKind::WorkerCrash,
                30..=41 => FaultKind::CoordinatorCrash,
                42..=56 => FaultKind::CoordinatorPartition,
                57..=71 => FaultKind::RingPartition,
                72..=85 => FaultKind::Stall,
                86..=92 => FaultKind::CheckpointStoreOutage,
                _ => FaultKind::RecordWriteOutage,
            };
            let at = self.rng.range(3000, self.cfg.fault_window_ms);
            self.at(at, Ev::Fault(kind));
        }
        let end = self.cfg.fault_window_ms;
        self.at(end, Ev::EndOfFaults);
    }

    /// Schedules `ev` at virtual time `at` (ties run in scheduling order).
    fn at(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.queue.insert((at.max(self.now), self.seq), ev);
    }

    /// Schedules `ev` `delay` ms from now.
    fn after(&mut self, delay: u64, ev: Ev) {
        self.at(self.now + delay, ev);
    }

    /// The machine's clock now.
    fn instant(&self) -> Instant {
        self.t0 + Duration::from_millis(self.now)
    }

    /// The wall clock now.
    fn wall(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(1_780_000_000_000 + self.now)
    }

    /// A one-way network latency.
    fn latency(&mut self) -> u64 {
        let j = self.net.jitter_ms;
        self.rng.range(1, j)
    }

    /// Whether worker `w` and the coordinator can talk now.
    fn link_up(&self, w: usize) -> bool {
        self.coord.machine.is_some() && !self.net.coord_cut[w]
    }

    /// Prints `what` when tracing.
    pub(super) fn trace(&self, what: impl FnOnce() -> String) {
        if self.cfg.trace {
            eprintln!("[{:>7} ms] {}", self.now, what());
        }
    }

    /// Records an invariant violation (the run goes on; the report lists them).
    fn violation(&mut self, what: String) {
        if self.report.violations.len() < 20 {
            self.report
                .violations
                .push(format!("t={} ms: {what}", self.now));
        } else {
            self.report.more_violations += 1;
        }
    }

    /// Runs to the end and checks the invariants.
    pub fn run(mut self) -> Report {
        let mut events = 0u64;
        while let Some(((t, _), ev)) = self.queue.pop_first() {
            events += 1;
            if events > self.cfg.max_events {
                self.violation(format!("more than {} events", self.cfg.max_events));
                break;
            }
            self.now = t;
            if t > self.cfg.deadline_ms {
                break;
            }
            if let Some(done) = self.all_done_at
                && t > done + 20_000
            {
                break;
            }
            self.handle(ev);
        }
        self.report.events = events;
        self.report.virtual_ms = self.now;
        self.final_checks();
        self.report
    }

    /// Dispatches one event.
    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Tick { epoch } => self.tick(epoch),
            Ev::Submit { job } => self.submit(job),
            Ev::SubmitPoll {
                job,
                id,
                epoch,
                since,
            } => self.submit_poll(job, id, epoch, since),
            Ev::CoordinatorRestart => self.coordinator_restart(),
            Ev::Deliver {
                w,
                inc,
                epoch,
                call,
                msg,
            } => self.deliver(w, inc, epoch, call, msg),
            Ev::Answer {
                w,
                inc,
                call,
                answer,
            } => self.on_answer(w, inc, call, answer),
            Ev::Command {
                w,
                inc,
                epoch,
                worker_id,
                command,
            } => {
                if epoch == self.coord.epoch {
                    self.on_command(w, inc, &worker_id, command)
                }
            }
            Ev::Driver { epoch, input } => self.driver_input(epoch, input),
            Ev::Heartbeat { w, inc } => self.on_heartbeat_timer(w, inc),
            Ev::Register { w, inc } => self.on_register_timer(w, inc),
            Ev::SessionLost { w, inc, worker_id } => self.on_session_lost(w, inc, &worker_id),
            Ev::WorkerRestart { w } => self.worker_restart(w),
            Ev::RingDeadline { ring } => self.ring_deadline(ring),
            Ev::RingStep { ring } => self.ring_step(ring),
            Ev::RingFail { ring, why } => self.ring_fail(ring, &why),
            Ev::UploadRetry { w, inc, serial } => self.upload_retry(w, inc, serial),
            Ev::Fault(kind) => self.fault(kind),
            Ev::Heal { what } => self.heal(what),
            Ev::EndOfFaults => self.end_of_faults(),
        }
    }

    /// Draws the target and length of one fault and applies it.
    fn fault(&mut self, kind: FaultKind) {
        if self.faults_over {
            return;
        }
        *self.report.faults.entry(kind).or_default() += 1;
        let n = self.workers.len() as u64;
        let w = self.rng.range(0, n - 1) as usize;
        self.trace(|| format!("fault {kind:?} (worker {w} if it names one)"));
        match kind {
            FaultKind::WorkerCrash => {
                self.worker_crash(w);
                let back = self.rng.range(500, 10_000);
                self.after(back, Ev::WorkerRestart { w });
            }
            FaultKind::CoordinatorCrash => {
                if self.coord.machine.is_some() {
                    self.coordinator_crash();
                    let back = self.rng.range(500, 8_000);
                    self.after(back, Ev::CoordinatorRestart);
                }
            }
            FaultKind::CoordinatorPartition => {
                self.net.coord_cut[w] = true;
                let heal = self.rng.range(500, 15_000);
                self.after(
                    heal,
                    Ev::Heal {
                        what: Heal::CoordinatorCut(w),
                    },
                );
            }
            FaultKind::RingPartition => {
                self.net.ring_cut[w] = true;
                self.ring_member_lost(w, "cut from its ring peers");
                let heal = self.rng.range(500, 15_000);
                self.after(
                    heal,
                    Ev::Heal {
                        what: Heal::RingCut(w),
                    },
                );
            }
            FaultKind::Stall => {
                let d = self.rng.range(500, 12_000);
                self.workers[w].stall_until = self.now + d;
            }
            FaultKind::CheckpointStoreOutage => {
                let d = self.rng.range(1_000, 20_000);
                self.coord.store_outage_until = self.now + d;
            }
            FaultKind::RecordWriteOutage => {
                let d = self.rng.range(1_000, 20_000);
                self.coord.record_outage_until = self.now + d;
            }
        }
    }

    /// A partition heals.
    fn heal(&mut self, what: Heal) {
        match what {
            Heal::CoordinatorCut(w) => self.net.coord_cut[w] = false,
            Heal::RingCut(w) => self.net.ring_cut[w] = false,
        }
    }

    /// The fault window closes: every cut heals, stalls and outages end (crashed processes
    /// come back on their own schedule, within seconds).
    fn end_of_faults(&mut self) {
        self.faults_over = true;
        self.net.coord_cut.iter_mut().for_each(|c| *c = false);
        self.net.ring_cut.iter_mut().for_each(|c| *c = false);
        for w in &mut self.workers {
            w.stall_until = 0;
        }
        self.coord.store_outage_until = 0;
        self.coord.record_outage_until = 0;
    }
}
