//! The rings' lockstep and each run's reporter. A ring starts once every rank has joined
//! (within its timeout, else every joined rank fails); from memory the root's replica is
//! broadcast, from a checkpoint or from scratch each rank loads its own. Each step every
//! rank applies `train_step` to its own weights, and they are compared. A member that leaves
//! (stopped: at once; crashed, cut off or stalled past the timeout: after the ring timeout)
//! fails the generation on every other member, which then reports a recoverable failure
//! holding its replica.

use super::worker::{Item, Stop};
use super::*;

/// Virtual milliseconds of one training step.
const STEP_MS: u64 = 200;

impl Sim {
    /// A member leaves ring `r`: the generation fails on the others `delay` ms later.
    pub(super) fn ring_member_left(&mut self, r: usize, delay: u64, why: &str) {
        if self.rings[r].broken {
            return;
        }
        self.rings[r].broken = true;
        self.after(
            delay,
            Ev::RingFail {
                ring: r,
                why: why.to_string(),
            },
        );
    }

    /// Worker `w` can no longer take part in its ring (crashed, cut off).
    pub(super) fn ring_member_lost(&mut self, w: usize, why: &str) {
        if let Some(run) = &self.workers[w].run
            && run.training
        {
            let r = run.ring;
            let timeout = self.rings[r].timeout_ms;
            self.ring_member_left(r, timeout, why);
        }
    }

    /// Whether `(w, serial)` still trains in its ring.
    fn member_ok(&self, w: usize, serial: u64) -> bool {
        let wk = &self.workers[w];
        wk.alive
            && !self.net.ring_cut[w]
            && wk
                .run
                .as_ref()
                .is_some_and(|r| r.serial == serial && r.training)
    }

    /// The ring's connect timeout: not every rank joined.
    pub(super) fn ring_deadline(&mut self, r: usize) {
        if self.rings[r].running || self.rings[r].broken {
            return;
        }
        self.rings[r].broken = true;
        self.ring_fail(r, "peers did not connect within the ring timeout");
    }

    /// Starts ring `r` if every rank has joined.
    pub(super) fn ring_try_start(&mut self, r: usize) {
        let ring = &self.rings[r];
        if ring.running || ring.broken || ring.joined.iter().any(Option::is_none) {
            return;
        }
        let joined: Vec<(usize, u64)> = ring.joined.iter().flatten().copied().collect();
        if joined.iter().any(|&(w, s)| !self.member_ok(w, s)) {
            return;
        }
        if self.rings[r].source == keel_proto::rpc::StateSource::Memory {
            let (root, _) = joined[self.rings[r].root as usize];
            let state = self.workers[root].run.as_ref().and_then(|x| x.replica);
            if state.is_none_or(|(s, _)| s != self.rings[r].step) {
                self.rings[r].broken = true;
                self.ring_fail(r, "the root rank holds no state of the start step");
                return;
            }
            for &(w, _) in &joined {
                if let Some(run) = self.workers[w].run.as_mut() {
                    run.replica = state;
                }
            }
        }
        self.rings[r].running = true;
        self.trace(|| format!("ring {r} starts at step {}", self.rings[r].step));
        let max = self.rings[r].max_steps;
        for &(w, _) in &joined {
            if let Some(run) = self.workers[w].run.as_mut()
                && run.checkpoint_first
                && let Some((step, weights)) = run.replica
            {
                run.queue.push_back(Item::Upload {
                    step,
                    weights,
                    last: step == max,
                });
            }
            self.pump(w);
        }
        if self.rings[r].step >= self.rings[r].max_steps {
            for &(w, _) in &joined {
                self.training_ends(w, Ok(()));
            }
            return;
        }
        self.schedule_step(r);
    }

    /// Schedules ring `r`'s next step, at the pace of its slowest member; a member stalled
    /// past the ring timeout fails the generation.
    fn schedule_step(&mut self, r: usize) {
        let stalled = self.rings[r]
            .joined
            .iter()
            .flatten()
            .map(|&(w, _)| self.workers[w].stall_until.saturating_sub(self.now))
            .max()
            .unwrap_or(0);
        if stalled > self.rings[r].timeout_ms {
            let timeout = self.rings[r].timeout_ms;
            self.ring_member_left(r, timeout, "a peer stalled past the ring timeout");
            return;
        }
        self.after(STEP_MS + stalled, Ev::RingStep { ring: r });
    }

    /// One lockstep of ring `r`.
    pub(super) fn ring_step(&mut self, r: usize) {
        if self.rings[r].broken || !self.rings[r].running {
            return;
        }
        let joined: Vec<(usize, u64)> = self.rings[r].joined.iter().flatten().copied().collect();
        if let Some(&(w, _)) = joined.iter().find(|&&(w, s)| !self.member_ok(w, s)) {
            // Left without its ring seeing it go yet (cut or crashed at this instant).
            let timeout = self.rings[r].timeout_ms;
            self.ring_member_left(r, timeout, &format!("rank of worker {w} is gone"));
            return;
        }
        let (step, gb, world) = (
            self.rings[r].step,
            self.rings[r].global_batch,
            joined.len() as u64,
        );
        let job = self.rings[r].key.job_id.clone();
        let next = step + 1;
        let mut all = BTreeSet::new();
        for (rank, &(w, _)) in joined.iter().enumerate() {
            let replica = self.workers[w].run.as_ref().and_then(|x| x.replica);
            let weights = match replica {
                Some((s, weights)) if s == step => weights,
                other => {
                    self.violation(format!(
                        "{job} gen {}: rank {rank} holds {other:?} before step {next}: a step \
                         skipped or applied twice",
                        self.rings[r].key.generation
                    ));
                    continue;
                }
            };
            let weights = train_step(weights, next, gb, world);
            all.insert(weights);
            self.reached.insert((job.clone(), next, weights));
            if let Some(run) = self.workers[w].run.as_mut() {
                run.replica = Some((next, weights));
            }
        }
        if all.len() > 1 {
            self.violation(format!(
                "{job} gen {}: ranks disagree after step {next}",
                self.rings[r].key.generation
            ));
        }
        self.rings[r].step = next;
        let (max, every) = (self.rings[r].max_steps, self.rings[r].every);
        let (w0, _) = joined[0];
        if let (Some(run), Some(&weights)) = (self.workers[w0].run.as_mut(), all.first()) {
            run.queue.push_back(Item::Step(next));
            if next == max || (every > 0 && next.is_multiple_of(every)) {
                run.queue.push_back(Item::Eval(next));
                run.queue.push_back(Item::Upload {
                    step: next,
                    weights,
                    last: next == max,
                });
            }
        }
        self.pump(w0);
        if next >= max {
            for &(w, _) in &joined {
                self.training_ends(w, Ok(()));
            }
        } else {
            self.schedule_step(r);
        }
    }

    /// The generation of ring `r` fails on every member still training in it.
    pub(super) fn ring_fail(&mut self, r: usize, why: &str) {
        let joined: Vec<(usize, u64)> = self.rings[r].joined.iter().flatten().copied().collect();
        for (w, serial) in joined {
            let wk = &self.workers[w];
            if wk.alive
                && wk
                    .run
                    .as_ref()
                    .is_some_and(|x| x.serial == serial && x.training)
            {
                self.training_ends(w, Err((format!("ring: {why}"), true)));
            }
        }
    }

    /// Worker `w`'s training ends with `outcome` (its reporter then drains).
    fn training_ends(&mut self, w: usize, outcome: Result<(), (String, bool)>) {
        if let Some(run) = self.workers[w].run.as_mut() {
            run.training = false;
            if run.outcome.is_none() {
                run.outcome = Some(outcome);
            }
        }
        self.pump(w);
    }

    /// Sends the reporter's next item, or the run's last word once it has drained.
    pub(super) fn pump(&mut self, w: usize) {
        let Some(run) = self.workers[w].run.as_mut() else {
            return;
        };
        if run.busy {
            return;
        }
        let serial = run.serial;
        let key = run.key.clone();
        let rank = run.rank;
        match run.queue.pop_front() {
            Some(Item::Step(step)) => {
                run.busy = true;
                let report = StepReport {
                    key: Some(TrainingKey { step, ..key }),
                    rank,
                    loss: 1.0,
                    ..Default::default()
                };
                self.rpc(w, Call::Report { serial }, Up::Step(report));
            }
            Some(Item::Eval(step)) => {
                run.busy = true;
                let report = EvalReport {
                    key: Some(TrainingKey { step, ..key }),
                    ..Default::default()
                };
                self.rpc(w, Call::Report { serial }, Up::Eval(report));
            }
            Some(Item::Upload {
                step,
                weights,
                last,
            }) => {
                run.busy = true;
                run.uploading = Some((step, weights, last));
                let key = TrainingKey { step, ..key };
                self.rpc(w, Call::UploadBegins { serial }, Up::UploadBegins(key));
            }
            None if run.training || run.outcome.is_none() => {}
            None => self.finish_run(w),
        }
    }

    /// The reporter's RPC was answered (`upload`: the upload's data, stored or not).
    pub(super) fn reporter_answered(&mut self, w: usize, serial: u64, upload: Option<bool>) {
        let inc = self.workers[w].inc;
        let Some(run) = self.workers[w].run.as_mut().filter(|r| r.serial == serial) else {
            return;
        };
        run.busy = false;
        if upload == Some(false)
            && let Some((step, weights, true)) = run.uploading
        {
            run.tries += 1;
            if run.stop.is_none() && run.tries < 60 {
                run.queue.push_front(Item::Upload {
                    step,
                    weights,
                    last: true,
                });
                run.busy = true;
                run.uploading = None;
                self.after(2000, Ev::UploadRetry { w, inc, serial });
                return;
            }
            run.outcome = Some(Err(("the final checkpoint was not uploaded".into(), true)));
        }
        if upload.is_some() {
            run.uploading = None;
        }
        self.pump(w);
    }

    /// An upload's start was answered: its data follows, or it failed.
    pub(super) fn upload_begun(&mut self, w: usize, serial: u64, ok: bool, _answer: Answer) {
        let Some(run) = self.workers[w].run.as_ref().filter(|r| r.serial == serial) else {
            return;
        };
        let Some((step, weights, _)) = run.uploading else {
            return;
        };
        if !ok {
            return self.reporter_answered(w, serial, Some(false));
        }
        let key = TrainingKey {
            step,
            ..run.key.clone()
        };
        self.rpc(
            w,
            Call::UploadData { serial },
            Up::UploadData { key, weights },
        );
    }

    /// The final upload's pause is over: try it again.
    pub(super) fn upload_retry(&mut self, w: usize, inc: u64, serial: u64) {
        if self.workers[w].inc != inc {
            return;
        }
        if let Some(run) = self.workers[w].run.as_mut().filter(|r| r.serial == serial) {
            run.busy = false;
            if run.stop.is_some() {
                run.queue
                    .retain(|i| !matches!(i, Item::Upload { last: true, .. }));
            }
        }
        self.pump(w);
    }

    /// The run has ended and its reporter drained: hold the replica and say how it ended.
    fn finish_run(&mut self, w: usize) {
        let Some(run) = self.workers[w].run.take() else {
            return;
        };
        self.trace(|| {
            format!(
                "worker {w} ends {} gen {} rank {}: {:?}, stop {:?}",
                run.key.job_id, run.key.generation, run.rank, run.outcome, run.stop
            )
        });
        let job = run.key.job_id.clone();
        self.workers[w].held = match (run.stop, run.replica) {
            (Some(Stop::Cancel), _) | (_, None) => None,
            (_, Some((s, weights))) => Some((job.clone(), s, weights)),
        };
        let held_steps = self.workers[w].held_steps(&job);
        let worker_id = self.workers[w]
            .session
            .as_ref()
            .map(|s| s.0.clone())
            .unwrap_or_default();
        let step = run.replica.map_or(run.key.step, |(s, _)| s);
        let key = Some(TrainingKey {
            step,
            ..run.key.clone()
        });
        match (run.outcome, run.stop) {
            (_, Some(Stop::Suspend { generation })) => {
                self.report_held(w, &job, generation, held_steps)
            }
            (_, Some(Stop::Cancel)) => {}
            (Some(Ok(())), None) => {
                let report = DoneReport {
                    key,
                    rank: run.rank,
                    worker_id,
                };
                self.rpc(w, Call::Last, Up::Done(report));
            }
            (outcome, None) => {
                let (error, recoverable) = match outcome {
                    Some(Err(e)) => e,
                    _ => ("ended without an outcome".to_string(), true),
                };
                let report = FailureReport {
                    key,
                    rank: run.rank,
                    worker_id,
                    error,
                    recoverable,
                    held_steps,
                };
                self.rpc(w, Call::Last, Up::Failure(report));
            }
        }
    }

    /// Worker `w`'s process dies: memory and session lost; its stream closes.
    pub(super) fn worker_crash(&mut self, w: usize) {
        if !self.workers[w].alive {
            return;
        }
        self.ring_member_lost(w, "a peer's connection was reset");
        let epoch = self.coord.epoch;
        if let Some((worker_id, attach)) = self.workers[w].session.take()
            && self.link_up(w)
        {
            self.after(
                5,
                Ev::Driver {
                    epoch,
                    input: DriverInput::Detached { worker_id, attach },
                },
            );
        }
        let wk = &mut self.workers[w];
        wk.alive = false;
        wk.inc += 1;
        wk.run = None;
        wk.held = None;
        wk.registering = false;
        wk.stall_until = 0;
    }

    /// Worker `w`'s process starts again (its cache kept: nothing else survives).
    pub(super) fn worker_restart(&mut self, w: usize) {
        if self.workers[w].alive {
            return;
        }
        self.workers[w].alive = true;
        self.workers[w].pause = 200;
        let inc = self.workers[w].inc;
        let d = self.rng.range(100, 500);
        self.after(d, Ev::Register { w, inc });
        self.after(d + 1000, Ev::Heartbeat { w, inc });
    }
}
