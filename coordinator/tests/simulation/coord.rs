//! The coordinator's side: the real `Machine` stepped with virtual time, and a model of the
//! driver (`keel_coordinator::driver`) that carries its effects out: commands onto the
//! simulated network, records into the simulated store (or a write failure fed back as
//! `SaveFailed`), preparations, file builds and checkpoint checks answered after a delay,
//! checkpoint folders removed. A crash drops the machine; a restart rebuilds it from the saved
//! records through the real `Machine::restore`.

use super::*;
use keel_coordinator::CoordinatorError;
use keel_coordinator::layout;
use keel_coordinator::machine::{Effect, Input, Registration, Reply, UploadFailure};
use keel_coordinator::persist::Restored;
use keel_coordinator::prepare_job::PreparedJob;
use std::path::PathBuf;
use std::sync::Arc;

/// Where the simulated jobs live (never touched: the store is in memory).
pub(super) fn jobs_dir() -> PathBuf {
    PathBuf::from("/nonexistent/sim/jobs")
}

/// A job's spec: `max_steps`, `checkpoint_every` and the ring's bounds drawn by the seed.
fn spec(max_steps: u64, every: u64, min: usize, max: usize, recoveries: u64) -> JobSpec {
    JobSpec::from_toml_str(
        &format!(
            "[data]\ncorpus = [\"/nonexistent/corpus.txt\"]\nvocab_size = 100\n[model]\n\
             preset = \"tiny\"\n[train]\nmicro_batch_size = 2\nmax_steps = {max_steps}\n\
             checkpoint_every = {every}\nkeep_checkpoints = 2\n[cluster]\nmin_workers = {min}\n\
             max_workers = {max}\npeer_timeout_seconds = 5\nmax_recoveries = {recoveries}\n\
             replacement_timeout_seconds = 60\nprogress_timeout_seconds = 30\n"
        ),
        "simulation",
    )
    .expect("the simulation's spec is valid")
}

/// The jobs of a run on `workers` workers: several at once, together asking for most of the
/// cluster, so that losses are replaced from the rest.
pub(super) fn job_specs(rng: &mut Rng, workers: usize) -> Vec<JobSpec> {
    let count = if workers >= 256 { 4 } else { 3 };
    let share = workers * 7 / 8 / count;
    (0..count)
        .map(|_| {
            let max = rng.range((share / 2) as u64, share as u64) as usize;
            let min = rng.range(1, (max / 2) as u64) as usize;
            let steps = rng.range(24, 48);
            let every = rng.range(4, 10);
            spec(steps, every, min, max, 24)
        })
        .collect()
}

/// A preparation's result (no file is ever read).
fn prepared() -> Arc<PreparedJob> {
    Arc::new(PreparedJob {
        data_dir: PathBuf::from("/nonexistent/sim/data"),
        total_sequences: 100_000,
        model_config_json: "{}".into(),
        shared_files: Vec::new(),
        memory_bytes: 1 << 20,
        later_phases: Vec::new(),
    })
}

impl Sim {
    /// Steps the machine with `input` now and carries out its effects; the reply, or an
    /// error when the coordinator is down.
    pub(super) fn step(&mut self, input: Input) -> Result<Reply, CoordinatorError> {
        let now = self.instant();
        let Some(m) = self.coord.machine.as_mut() else {
            return Err(CoordinatorError::BadRequest("coordinator down".into()));
        };
        let reply = m.step(now, input);
        self.carry_out();
        reply
    }

    /// The driver: takes the machine's effects and carries each out.
    fn carry_out(&mut self) {
        for _ in 0..1000 {
            let Some(m) = self.coord.machine.as_mut() else {
                return;
            };
            let effects = m.take_effects();
            if effects.is_empty() {
                return;
            }
            for e in effects {
                self.effect(e);
            }
        }
        self.violation("the machine kept producing effects".into());
    }

    /// Carries out one effect.
    fn effect(&mut self, e: Effect) {
        let epoch = self.coord.epoch;
        match &e {
            Effect::Send { worker_id, command } => self.trace(|| {
                format!("send {worker_id} {command:?}")
                    .chars()
                    .take(200)
                    .collect()
            }),
            Effect::Save { job_id, record, .. } => self.trace(|| {
                format!(
                    "save {job_id} {} gen {} step {} checkpoints {:?}",
                    record.state, record.generation, record.step, record.checkpoints
                )
            }),
            Effect::RemoveCheckpoints { dirs } => self.trace(|| format!("remove {dirs:?}")),
            Effect::VerifyCheckpoints { job_id, steps, .. } => {
                self.trace(|| format!("verify {job_id} {steps:?}"))
            }
            _ => {}
        }
        match e {
            Effect::Send { worker_id, command } => self.send_command(worker_id, command),
            Effect::Publish(_) | Effect::AppendMetrics { .. } => {}
            Effect::Save {
                job_id,
                record,
                seq,
                ..
            } => {
                if self.now < self.coord.record_outage_until {
                    self.after(
                        5,
                        Ev::Driver {
                            epoch,
                            input: DriverInput::SaveFailed { job_id },
                        },
                    );
                } else {
                    let generation = record.generation;
                    self.coord.records.insert(job_id.clone(), *record);
                    let d = self.rng.range(1, 5);
                    self.after(
                        d,
                        Ev::Driver {
                            epoch,
                            input: DriverInput::Saved {
                                job_id,
                                seq,
                                generation,
                            },
                        },
                    );
                }
            }
            Effect::Prepare { job_id, .. } => {
                self.coord.preparing.insert(job_id.clone());
                let d = self.rng.range(200, 1500);
                self.after(
                    d,
                    Ev::Driver {
                        epoch,
                        input: DriverInput::Prepared { job_id },
                    },
                );
            }
            Effect::BuildFiles(launch) => {
                let d = self.rng.range(10, 100);
                self.after(
                    d,
                    Ev::Driver {
                        epoch,
                        input: DriverInput::FilesBuilt {
                            job_id: launch.job_id.clone(),
                            generation: launch.generation,
                            ranks: launch.workers.len(),
                        },
                    },
                );
            }
            Effect::VerifyCheckpoints {
                job_id,
                generation,
                steps,
                ..
            } => {
                let newest = steps
                    .iter()
                    .rev()
                    .find(|s| self.store.contains_key(&(job_id.clone(), **s)))
                    .copied();
                let d = self.rng.range(10, 100);
                self.after(
                    d,
                    Ev::Driver {
                        epoch,
                        input: DriverInput::Verified {
                            job_id,
                            generation,
                            newest,
                        },
                    },
                );
            }
            Effect::RemoveCheckpoints { dirs } => {
                let gone: Vec<(String, u64)> = self
                    .store
                    .keys()
                    .filter(|(job, step)| {
                        dirs.contains(&layout::checkpoint_dir(&jobs_dir().join(job), *step))
                    })
                    .cloned()
                    .collect();
                for k in gone {
                    self.store.remove(&k);
                    self.pruned.insert(k);
                }
            }
        }
    }

    /// Puts a command on a worker's stream: lost when the worker is cut off or gone.
    fn send_command(&mut self, worker_id: String, command: worker_command::Command) {
        let Some(&w) = self.ids.get(&worker_id) else {
            return;
        };
        if !self.link_up(w) || !self.workers[w].alive {
            return;
        }
        let inc = self.workers[w].inc;
        let d = self.fifo(w, false);
        let epoch = self.coord.epoch;
        self.at(
            d,
            Ev::Command {
                w,
                inc,
                epoch,
                worker_id,
                command,
            },
        );
    }

    /// When a message on `w`'s connection (`reports`: its reporter's, else its session's)
    /// sent now arrives: after a random latency, never before one sent earlier.
    pub(super) fn fifo(&mut self, w: usize, reports: bool) -> u64 {
        let lat = self.latency();
        let last = self.net.last.get(&(w, reports)).copied().unwrap_or(0);
        let t = (self.now + lat).max(last + 1);
        self.net.last.insert((w, reports), t);
        t
    }

    /// The driver's timer.
    pub(super) fn tick(&mut self, epoch: u64) {
        if epoch != self.coord.epoch || self.coord.machine.is_none() {
            return;
        }
        let _ = self.step(Input::Tick);
        self.after(250, Ev::Tick { epoch });
        let all_done = self.submitted.iter().all(|s| {
            s.as_ref().is_some_and(|id| {
                self.coord
                    .machine
                    .as_ref()
                    .and_then(|m| m.job(id).ok())
                    .is_some_and(|j| j.is_finished())
            })
        });
        if all_done && self.faults_over && self.all_done_at.is_none() {
            self.all_done_at = Some(self.now);
        }
    }

    /// The user submits job `job` (again a second later while the coordinator is down;
    /// after a submission left without an answer, only if the coordinator does not know it).
    pub(super) fn submit(&mut self, job: usize) {
        let Some(m) = self.coord.machine.as_ref() else {
            self.after(1000, Ev::Submit { job });
            return;
        };
        if let Some(id) = self.in_doubt[job].take()
            && m.job(&id).is_ok()
        {
            self.trace(|| format!("{id}: the unanswered submission is there"));
            self.submitted[job] = Some(id);
            return;
        }
        let spec = self.to_submit[job].clone();
        let Ok(Reply::Reserved { id, dir }) = self.step(Input::Reserve { spec: spec.clone() })
        else {
            self.violation(format!("job {job} was not reserved"));
            return;
        };
        self.coord.specs.insert(id.clone(), spec.clone());
        let wall = self.wall();
        let _ = self.step(Input::Submitted {
            id: id.clone(),
            spec,
            dir,
            wall,
        });
        let epoch = self.coord.epoch;
        let since = self.now;
        self.after(
            1,
            Ev::SubmitPoll {
                job,
                id,
                epoch,
                since,
            },
        );
    }

    /// The submit handler (`CoordinatorService::recorded_or_withdrawn`): answers once the
    /// job's record is written; after 5 s without, withdraws the job, removes its folder and
    /// refuses (the user submits again a second later).
    pub(super) fn submit_poll(&mut self, job: usize, id: String, epoch: u64, since: u64) {
        let recorded = match self.coord.machine.as_ref() {
            Some(m) if epoch == self.coord.epoch => m.job(&id).is_ok_and(|j| j.is_recorded()),
            _ => {
                self.in_doubt[job] = Some(id);
                self.after(1000, Ev::Submit { job });
                return;
            }
        };
        if recorded {
            self.submitted[job] = Some(id);
        } else if self.now.saturating_sub(since) < 5000 {
            self.after(
                100,
                Ev::SubmitPoll {
                    job,
                    id,
                    epoch,
                    since,
                },
            );
        } else if self.step(Input::Withdraw { job_id: id.clone() }).is_ok() {
            self.trace(|| format!("{id}: submission refused, its record was not written"));
            self.coord.records.remove(&id);
            self.report.submissions_refused += 1;
            self.after(1000, Ev::Submit { job });
        } else {
            self.submitted[job] = Some(id);
        }
    }

    /// The coordinator process dies: the machine and everything in flight to it are lost;
    /// preparations under way are interrupted; every worker's stream breaks.
    pub(super) fn coordinator_crash(&mut self) {
        self.coord.machine = None;
        self.coord.epoch += 1;
        for id in std::mem::take(&mut self.coord.preparing) {
            *self.coord.interrupted.entry(id).or_default() += 1;
        }
        for w in 0..self.workers.len() {
            if let Some((id, _)) = self.workers[w].session.clone()
                && self.workers[w].alive
            {
                let inc = self.workers[w].inc;
                let d = self.rng.range(1, 50);
                self.after(
                    d,
                    Ev::SessionLost {
                        w,
                        inc,
                        worker_id: id,
                    },
                );
            }
        }
    }

    /// The coordinator starts again: a new machine takes back the saved records through
    /// the real restore path (`Machine::restore`).
    pub(super) fn coordinator_restart(&mut self) {
        if self.coord.machine.is_some() {
            return;
        }
        self.trace(|| "coordinator restarts".into());
        self.ids.clear();
        let mut restored: Vec<(u64, Restored)> = self
            .coord
            .records
            .iter()
            .map(|(id, record)| {
                let n = id.trim_start_matches("job-").parse::<u64>().unwrap_or(0);
                let r = Restored {
                    record: record.clone(),
                    spec: self.coord.specs[id].clone(),
                    dir: jobs_dir().join(id),
                    prepared: self.coord.data_ready.contains(id).then(prepared),
                    interrupted_preparations: self.coord.interrupted.get(id).copied().unwrap_or(0),
                    refused: None,
                };
                (n, r)
            })
            .collect();
        restored.sort_by_key(|(n, _)| *n);
        let highest = self.coord.specs.len() as u64;
        let mut m = Machine::new(jobs_dir());
        m.restore(
            self.instant(),
            self.wall(),
            restored.into_iter().map(|(_, r)| r).collect(),
            highest,
        );
        self.coord.machine = Some(m);
        self.carry_out();
        let epoch = self.coord.epoch;
        self.after(0, Ev::Tick { epoch });
    }

    /// A driver's result comes back (dropped if the process that asked has died).
    pub(super) fn driver_input(&mut self, epoch: u64, input: DriverInput) {
        if epoch != self.coord.epoch || self.coord.machine.is_none() {
            return;
        }
        let input = match input {
            DriverInput::Prepared { job_id } => {
                self.coord.preparing.remove(&job_id);
                self.coord.data_ready.insert(job_id.clone());
                Input::Prepared {
                    job_id,
                    result: Ok(prepared()),
                }
            }
            DriverInput::FilesBuilt {
                job_id,
                generation,
                ranks,
            } => Input::FilesBuilt {
                job_id,
                generation,
                result: Ok(vec![Vec::new(); ranks]),
            },
            DriverInput::Verified {
                job_id,
                generation,
                newest,
            } => Input::CheckpointsVerified {
                job_id,
                generation,
                newest,
            },
            DriverInput::SaveFailed { job_id } => {
                self.trace(|| format!("save of {job_id} failed"));
                Input::SaveFailed {
                    job_id,
                    error: "no space left on device (simulated)".into(),
                    storage_full: true,
                }
            }
            DriverInput::Saved {
                job_id,
                seq,
                generation,
            } => Input::Saved {
                job_id,
                seq,
                generation,
            },
            DriverInput::Detached { worker_id, attach } => Input::Detached { worker_id, attach },
        };
        let _ = self.step(input);
    }

    /// An RPC reaches the coordinator: the service's handler steps the machine and answers.
    pub(super) fn deliver(&mut self, w: usize, inc: u64, epoch: u64, call: Call, msg: Up) {
        self.trace(|| format!("rpc from {w}: {msg:?}").chars().take(200).collect());
        let answer = if epoch != self.coord.epoch || self.coord.machine.is_none() {
            Answer::Err("the coordinator went away".into())
        } else {
            self.handle_rpc(w, msg)
        };
        let d = if self.link_up(w) {
            self.latency()
        } else {
            self.rng.range(200, 1000)
        };
        let answer = if self.link_up(w) {
            answer
        } else {
            Answer::Err("no answer".into())
        };
        self.after(
            d,
            Ev::Answer {
                w,
                inc,
                call,
                answer,
            },
        );
    }

    /// The service's handler of one RPC.
    fn handle_rpc(&mut self, w: usize, msg: Up) -> Answer {
        let err = |e: CoordinatorError| Answer::Err(e.to_string());
        match msg {
            Up::Register { holds } => {
                let r = self.step(Input::Register(Registration {
                    advertise_addr: self.workers[w].addr.clone(),
                    threads: 1,
                    hostname: format!("sim-{w}"),
                    holds,
                    ..Default::default()
                }));
                match r {
                    Ok(Reply::Registered { worker_id }) => {
                        self.coord.attach += 1;
                        let attach = self.coord.attach;
                        self.ids.insert(worker_id.clone(), w);
                        match self.step(Input::Attached {
                            worker_id: worker_id.clone(),
                            attach,
                        }) {
                            Ok(_) => Answer::Registered {
                                worker_id,
                                attach,
                                epoch: self.coord.epoch,
                            },
                            Err(e) => err(e),
                        }
                    }
                    Ok(other) => Answer::Err(format!("{other:?}")),
                    Err(e) => err(e),
                }
            }
            Up::Heartbeat { key } => {
                let worker_id = self.workers[w]
                    .session
                    .as_ref()
                    .map(|s| s.0.clone())
                    .unwrap_or_default();
                match self.step(Input::Heartbeat {
                    worker_id,
                    key,
                    times: None,
                }) {
                    Ok(Reply::Known(k)) => Answer::Known(k),
                    Ok(_) => Answer::Ok,
                    Err(e) => err(e),
                }
            }
            Up::Step(r) => self.step(Input::Step(r)).map_or_else(err, |_| Answer::Ok),
            Up::Eval(r) => self.step(Input::Eval(r)).map_or_else(err, |_| Answer::Ok),
            Up::Done(r) => self.step(Input::Done(r)).map_or_else(err, |_| Answer::Ok),
            Up::Failure(r) => self
                .step(Input::Failure(r))
                .map_or_else(err, |_| Answer::Ok),
            Up::Held(r) => self.step(Input::Held(r)).map_or_else(err, |_| Answer::Ok),
            Up::UploadBegins(key) => self
                .step(Input::UploadBegins(key))
                .map_or_else(err, |_| Answer::Ok),
            Up::UploadData { key, weights } => {
                if self.now < self.coord.store_outage_until {
                    let failure = UploadFailure {
                        path: layout::checkpoint_dir(&jobs_dir().join(&key.job_id), key.step),
                        key,
                        needed_bytes: Some(1 << 30),
                        free_bytes: Some(1 << 20),
                        error: "no room".into(),
                    };
                    let _ = self.step(Input::UploadFailed(failure));
                    return Answer::Err("the checkpoint could not be stored".into());
                }
                // The upload handler writes the folder, then tells the machine.
                self.store.insert((key.job_id.clone(), key.step), weights);
                self.step(Input::CheckpointStored(key))
                    .map_or_else(err, |_| Answer::Ok)
            }
        }
    }
}
