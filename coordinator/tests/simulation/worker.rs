//! A model of the worker process (`worker/src/serve/` and `worker/src/job.rs`) and of its
//! rings. A worker registers (naming what it holds), heartbeats every second (ending its
//! session after 5 failures or when the coordinator forgets it, then registering again),
//! and obeys `Start` (stop any other job, take the held replica of the job, join the ring),
//! `Suspend` (stop the job and report what it holds, or report at once when not training) and
//! `Cancel` (stop the job and drop what it holds). A run's reporter sends, in order, rank 0's
//! step and eval reports and checkpoint uploads (the final one tried again every 2 s until
//! stored or stopped); when the run ends it says so once: done, failure (with held steps),
//! held (after a Suspend) or nothing (after a Cancel), as `serve/outcome.rs` does.

use super::*;
use keel_proto::rpc::StateSource;
use std::collections::VecDeque;

/// Why a run was stopped (`serve/state.rs`'s `StopReason`, less the shutdown).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Stop {
    /// A `Suspend` for `generation`: the run's last word is the held report.
    Suspend { generation: u64 },
    /// A `Cancel` (or another job's `Start`): the replica is dropped, nothing is said.
    Cancel,
}

/// One queued item of a run's reporter.
#[derive(Debug, Clone)]
pub(super) enum Item {
    /// The step report of a step.
    Step(u64),
    /// The eval report at a step.
    Eval(u64),
    /// The checkpoint of `step` (`last`: the final one, tried again until stored).
    Upload { step: u64, weights: u64, last: bool },
}

/// One generation of a job on this worker.
#[derive(Debug)]
pub(super) struct Run {
    /// This run's serial number (answers and ring slots name it).
    pub(super) serial: u64,
    /// Its job, generation and start step.
    pub(super) key: TrainingKey,
    /// Its rank.
    pub(super) rank: u32,
    /// Its ring.
    pub(super) ring: usize,
    /// `(step, weights)` of its replica, once it has one.
    pub(super) replica: Option<(u64, u64)>,
    /// In the ring's lockstep (not failed, stopped or finished).
    pub(super) training: bool,
    /// How training ended: `Ok`, or the error and whether it may be recovered from.
    pub(super) outcome: Option<Result<(), (String, bool)>>,
    /// Why it was stopped from outside, if it was.
    pub(super) stop: Option<Stop>,
    /// The reporter's items not sent yet, in order.
    pub(super) queue: VecDeque<Item>,
    /// Stage a checkpoint of the start step once the ring has started (after the broadcast,
    /// as `Trainer::run` does).
    pub(super) checkpoint_first: bool,
    /// An RPC of the reporter is in flight (or an upload waits to be retried).
    pub(super) busy: bool,
    /// The upload in flight.
    pub(super) uploading: Option<(u64, u64, bool)>,
    /// Attempts of the final upload so far.
    pub(super) tries: u32,
}

/// One simulated worker process.
#[derive(Debug)]
pub(super) struct Worker {
    /// Its advertise address (ring peers are named by it).
    pub(super) addr: String,
    /// Its process runs.
    pub(super) alive: bool,
    /// Incarnation: bumped at each restart, so that the old process's events are dropped.
    pub(super) inc: u64,
    /// `(worker id, attach stream)` of the live session.
    pub(super) session: Option<(String, u64)>,
    /// A registration is in flight.
    pub(super) registering: bool,
    /// The coordinator process (epoch) of the live session: its commands come from it.
    pub(super) epoch: u64,
    /// The pause before the next registration attempt (200 ms doubling to 2 s).
    pub(super) pause: u64,
    /// Heartbeats failed in a row.
    pub(super) hb_failures: u32,
    /// The job generation it runs, if any.
    pub(super) run: Option<Run>,
    /// `(job, step, weights)` held between generations.
    pub(super) held: Option<(String, u64, u64)>,
    /// It computes slowly until then (virtual ms).
    pub(super) stall_until: u64,
}

impl Worker {
    /// Worker `i`, not started.
    pub(super) fn new(i: usize) -> Self {
        Worker {
            addr: format!("10.{}.{}.{}:7071", i / 65536, (i / 256) % 256, i % 256),
            alive: true,
            inc: 0,
            session: None,
            registering: false,
            epoch: 0,
            pause: 200,
            hb_failures: 0,
            run: None,
            held: None,
            stall_until: 0,
        }
    }

    /// What it names at registration: the running job's key, else the held replica's.
    fn holds(&self) -> Option<TrainingKey> {
        if let Some(r) = &self.run {
            return Some(TrainingKey {
                step: r.replica.map_or(r.key.step, |(s, _)| s),
                ..r.key.clone()
            });
        }
        self.held.as_ref().map(|(job, step, _)| TrainingKey {
            job_id: job.clone(),
            generation: 0,
            step: *step,
        })
    }

    /// The steps held of `job` (empty if none).
    pub(super) fn held_steps(&self, job: &str) -> Vec<u64> {
        self.held
            .iter()
            .filter(|h| h.0 == job)
            .map(|h| h.1)
            .collect()
    }
}

/// A ring of one generation: its members by rank and its lockstep.
#[derive(Debug)]
pub(super) struct Ring {
    /// Its job, generation and start step.
    pub(super) key: TrainingKey,
    /// The simulated worker of each rank, from the `StartJob`'s peers.
    pub(super) members: Vec<Option<usize>>,
    /// `(worker, run serial)` of each rank that joined.
    pub(super) joined: Vec<Option<(usize, u64)>>,
    /// Where its start state comes from.
    pub(super) source: StateSource,
    /// The rank whose replica is broadcast (from memory).
    pub(super) root: u32,
    /// The job's global batch (in every step's hash).
    pub(super) global_batch: u64,
    /// The job's last step.
    pub(super) max_steps: u64,
    /// `checkpoint_every`.
    pub(super) every: u64,
    /// The ring timeout (connect, and a peer's silence).
    pub(super) timeout_ms: u64,
    /// The last step completed.
    pub(super) step: u64,
    /// Every rank joined and it runs.
    pub(super) running: bool,
    /// A member left: no more steps.
    pub(super) broken: bool,
}

impl Sim {
    /// Sends an RPC from worker `w`; it fails at the caller when the link is down or it is
    /// lost.
    pub(super) fn rpc(&mut self, w: usize, call: Call, msg: Up) {
        let inc = self.workers[w].inc;
        let drop = self.rng.chance(self.net.drop_p);
        if !self.link_up(w) || drop {
            let d = self.rng.range(200, 1000);
            let answer = Answer::Err("unavailable".into());
            self.after(
                d,
                Ev::Answer {
                    w,
                    inc,
                    call,
                    answer,
                },
            );
            return;
        }
        let at = self.fifo(w, !matches!(call, Call::Heartbeat | Call::Register));
        let epoch = self.coord.epoch;
        self.at(
            at,
            Ev::Deliver {
                w,
                inc,
                epoch,
                call,
                msg,
            },
        );
    }

    /// The registration loop: try now, and again after a growing pause until it works.
    pub(super) fn on_register_timer(&mut self, w: usize, inc: u64) {
        let wk = &mut self.workers[w];
        if !wk.alive || wk.inc != inc || wk.session.is_some() || wk.registering {
            return;
        }
        wk.registering = true;
        let holds = wk.holds();
        self.rpc(w, Call::Register, Up::Register { holds });
    }

    /// The heartbeat timer (every second while the process lives).
    pub(super) fn on_heartbeat_timer(&mut self, w: usize, inc: u64) {
        if !self.workers[w].alive || self.workers[w].inc != inc {
            return;
        }
        self.after(1000, Ev::Heartbeat { w, inc });
        if self.workers[w].session.is_none() {
            return;
        }
        let key = self.workers[w].run.as_ref().map(|r| TrainingKey {
            step: r.replica.map_or(r.key.step, |(s, _)| s),
            ..r.key.clone()
        });
        self.rpc(w, Call::Heartbeat, Up::Heartbeat { key });
    }

    /// The session ended (the stream broke, heartbeats failed, the coordinator forgot it):
    /// the worker goes on training and registers again.
    pub(super) fn on_session_lost(&mut self, w: usize, inc: u64, worker_id: &str) {
        let wk = &mut self.workers[w];
        if !wk.alive || wk.inc != inc || wk.session.as_ref().is_none_or(|s| s.0 != worker_id) {
            return;
        }
        wk.session = None;
        wk.hb_failures = 0;
        let pause = wk.pause;
        self.after(pause, Ev::Register { w, inc });
    }

    /// An RPC's answer.
    pub(super) fn on_answer(&mut self, w: usize, inc: u64, call: Call, answer: Answer) {
        if !self.workers[w].alive || self.workers[w].inc != inc {
            return;
        }
        if let Answer::Err(e) = &answer {
            self.trace(|| format!("worker {w}: {call:?} failed: {e}"));
        }
        match call {
            Call::Register => {
                let wk = &mut self.workers[w];
                wk.registering = false;
                match answer {
                    Answer::Registered {
                        worker_id,
                        attach,
                        epoch,
                    } => {
                        wk.session = Some((worker_id, attach));
                        wk.epoch = epoch;
                        wk.hb_failures = 0;
                        wk.pause = 200;
                    }
                    _ => {
                        let pause = wk.pause;
                        wk.pause = (wk.pause * 2).min(2000);
                        self.after(pause, Ev::Register { w, inc });
                    }
                }
            }
            Call::Heartbeat => {
                let Some((id, _)) = self.workers[w].session.clone() else {
                    return;
                };
                let lost = match answer {
                    Answer::Known(false) => true,
                    Answer::Err(_) => {
                        self.workers[w].hb_failures += 1;
                        self.workers[w].hb_failures >= 5
                    }
                    _ => {
                        self.workers[w].hb_failures = 0;
                        false
                    }
                };
                if lost {
                    self.on_session_lost(w, inc, &id);
                }
            }
            Call::Report { serial } => self.reporter_answered(w, serial, None),
            Call::UploadBegins { serial } => {
                let ok = matches!(answer, Answer::Ok);
                self.upload_begun(w, serial, ok, answer);
            }
            Call::UploadData { serial } => {
                let ok = matches!(answer, Answer::Ok);
                self.reporter_answered(w, serial, Some(ok));
            }
            Call::Last => {}
        }
    }

    /// A command from the coordinator, on the stream of session `worker_id`.
    pub(super) fn on_command(
        &mut self,
        w: usize,
        inc: u64,
        worker_id: &str,
        command: worker_command::Command,
    ) {
        let wk = &self.workers[w];
        if !wk.alive || wk.inc != inc || wk.session.as_ref().is_none_or(|s| s.0 != worker_id) {
            return;
        }
        match command {
            worker_command::Command::Start(start) => self.start(w, start),
            worker_command::Command::Cancel(c) => {
                let Some(key) = c.key else { return };
                self.stop_running(w, Some(&key.job_id), Stop::Cancel);
                if self.workers[w]
                    .held
                    .as_ref()
                    .is_some_and(|h| h.0 == key.job_id)
                {
                    self.workers[w].held = None;
                }
            }
            worker_command::Command::Suspend(s) => {
                let Some(key) = s.key else { return };
                let stop = Stop::Suspend {
                    generation: key.generation,
                };
                if !self.stop_running(w, Some(&key.job_id), stop) {
                    let steps = self.workers[w].held_steps(&key.job_id);
                    self.report_held(w, &key.job_id, key.generation, steps);
                }
            }
        }
    }

    /// Sends `ReportHeld`.
    pub(super) fn report_held(
        &mut self,
        w: usize,
        job: &str,
        generation: u64,
        held_steps: Vec<u64>,
    ) {
        let worker_id = self.workers[w]
            .session
            .as_ref()
            .map(|s| s.0.clone())
            .unwrap_or_default();
        let report = HeldReport {
            key: Some(TrainingKey {
                job_id: job.to_string(),
                generation,
                step: held_steps.iter().copied().max().unwrap_or(0),
            }),
            worker_id,
            held_steps,
        };
        self.rpc(w, Call::Last, Up::Held(report));
    }

    /// Stops the running job if it is `job` (any if `None`) and has not ended; whether it
    /// stopped one.
    fn stop_running(&mut self, w: usize, job: Option<&str>, why: Stop) -> bool {
        let Some(run) = self.workers[w].run.as_mut() else {
            return false;
        };
        if job.is_some_and(|j| j != run.key.job_id) {
            return false;
        }
        run.stop = Some(why);
        // The final upload's retries watch the stop; the other items are still sent.
        run.queue
            .retain(|i| !matches!(i, Item::Upload { last: true, .. }));
        let ring = run.ring;
        if run.training {
            run.training = false;
            run.outcome = Some(Err(("stopped".into(), true)));
            self.ring_member_left(ring, 20, "a peer left the ring");
        } else if run.outcome.is_none() {
            run.outcome = Some(Err(("stopped".into(), true)));
        }
        self.pump(w);
        true
    }

    /// `StartJob`: stop anything else, take the held replica of this job, join the ring.
    fn start(&mut self, w: usize, s: keel_proto::rpc::StartJob) {
        let Some(key) = s.key.clone() else { return };
        self.trace(|| {
            format!(
                "worker {w} starts {} gen {} rank {}",
                key.job_id, key.generation, s.rank
            )
        });
        if let Some(old) = self.workers[w].run.take()
            && old.training
        {
            self.ring_member_left(old.ring, 20, "a peer left the ring");
        }
        let held = self.workers[w]
            .held
            .take()
            .filter(|h| h.0 == key.job_id)
            .map(|h| (h.1, h.2));
        self.run_serial += 1;
        let serial = self.run_serial;
        let source = StateSource::try_from(s.state_source).unwrap_or(StateSource::Init);
        let (mut replica, mut failed) = (None, None);
        match source {
            StateSource::Init => replica = Some((0, init_weights(&key.job_id))),
            StateSource::Checkpoint => match self.store.get(&(key.job_id.clone(), s.start_step)) {
                Some(&weights) => replica = Some((s.start_step, weights)),
                None => {
                    failed = Some(format!(
                        "checkpoint missing: step {} of {} is not in the store",
                        s.start_step, key.job_id
                    ))
                }
            },
            StateSource::Memory => {
                replica = held;
                if s.rank == s.state_root_rank && held.is_none_or(|h| h.0 != s.start_step) {
                    self.violation(format!(
                        "{} generation {}: root rank {} holds {held:?}, not step {}",
                        key.job_id, key.generation, s.rank, s.start_step
                    ));
                }
            }
        }
        let world = s.world_size as usize;
        let epoch = self.workers[w].epoch;
        let launched = self
            .launched_by
            .entry((key.job_id.clone(), key.generation))
            .or_insert(epoch);
        if *launched != epoch {
            self.violation(format!(
                "{} generation {} launched again by a restarted coordinator",
                key.job_id, key.generation
            ));
        }
        // Rings are told apart by the process that formed them too, so that a generation
        // number launched again (a violation) does not merge two rings.
        let ring = match self
            .ring_index
            .get(&(key.job_id.clone(), key.generation, epoch))
        {
            Some(&r) => r,
            None => {
                let members = s
                    .peers
                    .iter()
                    .map(|p| self.workers.iter().position(|x| x.addr == *p))
                    .collect();
                self.rings.push(Ring {
                    key: key.clone(),
                    members,
                    joined: vec![None; world],
                    source,
                    root: s.state_root_rank,
                    global_batch: s.global_batch_size,
                    max_steps: 0,
                    every: 0,
                    timeout_ms: s.ring_timeout_ms.max(1000),
                    step: s.start_step,
                    running: false,
                    broken: false,
                });
                let r = self.rings.len() - 1;
                self.ring_index
                    .insert((key.job_id.clone(), key.generation, epoch), r);
                let timeout = self.rings[r].timeout_ms;
                self.after(timeout, Ev::RingDeadline { ring: r });
                let worlds = self
                    .worlds
                    .entry(key.job_id.clone())
                    .or_insert((BTreeSet::new(), s.global_batch_size));
                worlds.0.insert(s.world_size);
                r
            }
        };
        let spec: Option<JobSpec> = serde_json::from_str(&s.spec_json).ok();
        if let Some(spec) = spec {
            self.rings[ring].max_steps = spec.train.max_steps;
            self.rings[ring].every = spec.train.checkpoint_every;
        }
        self.workers[w].run = Some(Run {
            serial,
            key,
            rank: s.rank,
            ring,
            replica,
            training: failed.is_none(),
            outcome: failed.map(|f| Err((f, false))),
            stop: None,
            queue: VecDeque::new(),
            checkpoint_first: s.checkpoint_first,
            busy: false,
            uploading: None,
            tries: 0,
        });
        if self.workers[w].run.as_ref().is_some_and(|r| !r.training) {
            self.pump(w);
            return;
        }
        let rank = s.rank as usize;
        self.trace(|| format!("worker {w} joins ring {ring} as rank {rank} (epoch {epoch})"));
        if self.rings[ring].members.get(rank) != Some(&Some(w)) {
            self.violation(format!(
                "{} generation {}: rank {rank}'s StartJob went to worker {w}, which its peers \
                 list does not name at that rank",
                self.rings[ring].key.job_id, self.rings[ring].key.generation
            ));
        }
        if rank < world {
            self.rings[ring].joined[rank] = Some((w, serial));
        }
        if self.rings[ring].broken {
            // Its peers are gone: joining times out.
            let timeout = self.rings[ring].timeout_ms;
            let why = "the ring's peers are gone".to_string();
            self.after(timeout, Ev::RingFail { ring, why });
        }
        self.ring_try_start(ring);
        self.pump(w);
    }
}
