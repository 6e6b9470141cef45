//! Table-driven tests of the machine with injected time: every transition that only an
//! end-to-end cluster reached before. A harness plays the driver: it feeds inputs at chosen
//! instants, answers preparations and file builds, and reads the effects.

mod durability;
mod lifecycle;
mod recovery;
mod ring;
mod storage;
mod trust;

use crate::machine::phase::{Outcome, Phase, Stage};
use crate::machine::*;
use crate::persist::Restored;
use crate::persist::{FORMAT_VERSION, LastMetrics};
use crate::prepare_job::PreparedJob;
use keel_proto::rpc::{
    DoneReport, FailureReport, HeldReport, JobState, StartJob, StateSource, StepReport,
};
use std::sync::Arc;
use std::time::Duration;
/// The spec of a test job, with `[cluster]` lines `cluster` (`max_workers` 8 unless given).
pub(super) fn spec(cluster: &str) -> JobSpec {
    spec_with("", cluster)
}

/// [`spec`] with more `[train]` lines.
pub(super) fn spec_with(train: &str, cluster: &str) -> JobSpec {
    let max = if cluster.contains("max_workers") {
        ""
    } else {
        "max_workers = 8"
    };
    JobSpec::from_toml_str(
        &format!(
            "[data]\ncorpus = [\"/nonexistent/corpus.txt\"]\nvocab_size = 100\n[model]\n\
             preset = \"tiny\"\n[train]\nmicro_batch_size = 2\nmax_steps = 20\n\
             checkpoint_every = 4\n{train}\n[cluster]\npeer_timeout_seconds = 5\n{max}\n{cluster}\n"
        ),
        "test",
    )
    .unwrap()
}

/// A preparation's result, without any file.
pub(super) fn prepared() -> Arc<PreparedJob> {
    Arc::new(PreparedJob {
        data_dir: PathBuf::from("/nonexistent/data"),
        total_sequences: 1000,
        model_config_json: "{}".into(),
        shared_files: Vec::new(),
        memory_bytes: 1 << 20,
        later_phases: Vec::new(),
    })
}

/// The machine and a clock.
pub(super) struct Harness {
    pub(super) m: Machine,
    t0: Instant,
    pub(super) now: Instant,
    /// Effects not yet looked at.
    seen: Vec<Effect>,
    /// Records handed out are written at once ([`Input::Saved`]), as by a driver whose disk
    /// works; when false they stay unconfirmed until a test says otherwise.
    pub(super) writes_records: bool,
}

impl Harness {
    pub(super) fn new() -> Self {
        let t0 = Instant::now();
        Harness {
            m: Machine::new(PathBuf::from("/nonexistent/jobs")),
            t0,
            now: t0,
            seen: Vec::new(),
            writes_records: true,
        }
    }

    /// Moves the clock to `t0 + seconds`.
    pub(super) fn at(&mut self, seconds: f64) -> &mut Self {
        self.now = self.t0 + Duration::from_secs_f64(seconds);
        self
    }

    /// Feeds `input` now; answers builds and preparations as a driver would.
    pub(super) fn feed(&mut self, input: Input) -> Result<Reply, CoordinatorError> {
        let reply = self.m.step(self.now, input);
        self.drain();
        reply
    }

    /// Takes the machine's effects; file builds succeed at once (one empty list per rank), and
    /// records are written at once while `writes_records`.
    pub(super) fn drain(&mut self) {
        loop {
            let effects = self.m.take_effects();
            if effects.is_empty() {
                return;
            }
            for e in effects {
                if let Effect::BuildFiles(l) = &e {
                    let input = Input::FilesBuilt {
                        job_id: l.job_id.clone(),
                        generation: l.generation,
                        result: Ok(vec![Vec::new(); l.workers.len()]),
                    };
                    self.seen.push(e.clone());
                    let _ = self.m.step(self.now, input);
                    continue;
                }
                if let Effect::Save {
                    job_id,
                    record,
                    seq,
                    ..
                } = &e
                    && self.writes_records
                {
                    let input = Input::Saved {
                        job_id: job_id.clone(),
                        seq: *seq,
                        generation: record.generation,
                    };
                    self.seen.push(e.clone());
                    let _ = self.m.step(self.now, input);
                    continue;
                }
                self.seen.push(e);
            }
        }
    }

    pub(super) fn tick(&mut self) {
        self.feed(Input::Tick).unwrap();
    }

    /// Registers and attaches a worker at `addr`, holding `holds`; its id.
    pub(super) fn worker(&mut self, addr: &str, holds: Option<TrainingKey>) -> String {
        let r = self.feed(Input::Register(Registration {
            advertise_addr: addr.into(),
            holds,
            ..Default::default()
        }));
        let Ok(Reply::Registered { worker_id }) = r else {
            panic!("{r:?}")
        };
        self.feed(Input::Attached {
            worker_id: worker_id.clone(),
            attach: 1,
        })
        .unwrap();
        worker_id
    }

    /// Submits a job (queued); its id.
    pub(super) fn submit(&mut self, spec: JobSpec) -> String {
        let Ok(Reply::Reserved { id, dir }) = self.feed(Input::Reserve { spec: spec.clone() })
        else {
            panic!("not reserved")
        };
        let wall = SystemTime::now();
        self.feed(Input::Submitted {
            id: id.clone(),
            spec,
            dir,
            wall,
        })
        .unwrap();
        id
    }

    /// Submits a job and prepares it: it waits for workers (or has started, if they are there).
    pub(super) fn job(&mut self, spec: JobSpec) -> String {
        let id = self.submit(spec);
        self.tick();
        assert!(self.take(|e| matches!(e, Effect::Prepare { .. })).len() == 1);
        let result = Ok(prepared());
        self.feed(Input::Prepared {
            job_id: id.clone(),
            result,
        })
        .unwrap();
        id
    }

    /// The effects seen since the last call that `keep` accepts (all are then forgotten).
    pub(super) fn take(&mut self, keep: impl Fn(&Effect) -> bool) -> Vec<Effect> {
        std::mem::take(&mut self.seen)
            .into_iter()
            .filter(|e| keep(e))
            .collect()
    }

    /// The StartJob commands sent since the last look, as (worker, start).
    pub(super) fn starts(&mut self) -> Vec<(String, StartJob)> {
        self.take(|_| true)
            .into_iter()
            .filter_map(|e| match e {
                Effect::Send {
                    worker_id,
                    command: worker_command::Command::Start(s),
                } => Some((worker_id, s)),
                _ => None,
            })
            .collect()
    }

    /// The workers sent a command that `is` accepts since the last look.
    pub(super) fn sent(&mut self, is: impl Fn(&worker_command::Command) -> bool) -> Vec<String> {
        self.take(|_| true)
            .into_iter()
            .filter_map(|e| match e {
                Effect::Send { worker_id, command } if is(&command) => Some(worker_id),
                _ => None,
            })
            .collect()
    }

    pub(super) fn state(&self, job: &str) -> JobState {
        self.m.job(job).unwrap().state()
    }

    pub(super) fn generation(&self, job: &str) -> u64 {
        self.m.job(job).unwrap().generation()
    }

    pub(super) fn key(&self, job: &str, step: u64) -> TrainingKey {
        TrainingKey {
            job_id: job.into(),
            generation: self.generation(job),
            step,
        }
    }

    /// Worker `w` answers the Suspend of the regroup with `held`.
    pub(super) fn held(&mut self, job: &str, w: &str, held: &[u64]) {
        let key = Some(self.key(job, 0));
        self.feed(Input::Held(HeldReport {
            key,
            worker_id: w.into(),
            held_steps: held.to_vec(),
        }))
        .unwrap();
    }

    /// Ranks `0..ranks` report done at `step`.
    pub(super) fn done(&mut self, job: &str, ranks: u32, step: u64) {
        for rank in 0..ranks {
            let key = Some(self.key(job, step));
            self.feed(Input::Done(DoneReport {
                key,
                rank,
                ..Default::default()
            }))
            .unwrap();
        }
    }

    /// Rank 0 reports `step`.
    pub(super) fn step(&mut self, job: &str, step: u64) {
        let key = Some(self.key(job, step));
        self.feed(Input::Step(StepReport {
            key,
            rank: 0,
            loss: 1.0,
            ..Default::default()
        }))
        .unwrap();
    }

    /// Heartbeats of `workers` now, naming the job's step.
    pub(super) fn heartbeats(&mut self, job: &str, workers: &[&str], step: u64) {
        for w in workers {
            let key = Some(self.key(job, step));
            self.feed(Input::Heartbeat {
                worker_id: w.to_string(),
                key,
                times: None,
            })
            .unwrap();
        }
    }

    pub(super) fn metrics_events(&mut self) -> Vec<String> {
        self.take(|_| true)
            .into_iter()
            .filter_map(|e| match e {
                Effect::AppendMetrics { line, .. } => {
                    line.to_value()["event"].as_str().map(String::from)
                }
                _ => None,
            })
            .collect()
    }
}

pub(super) fn is_suspend(c: &worker_command::Command) -> bool {
    matches!(c, worker_command::Command::Suspend(_))
}

pub(super) fn is_cancel(c: &worker_command::Command) -> bool {
    matches!(c, worker_command::Command::Cancel(_))
}

/// A running job on `n` workers (min `min`, max `max`): the harness, job and workers.
pub(super) fn running(n: usize, cluster: &str) -> (Harness, String, Vec<String>) {
    let mut h = Harness::new();
    let workers: Vec<String> = (0..n)
        .map(|i| h.worker(&format!("127.0.0.1:{}", 7100 + i), None))
        .collect();
    let job = h.job(spec(cluster));
    h.tick();
    let starts = h.starts();
    assert_eq!(starts.len(), n, "every rank is started");
    assert_eq!(h.state(&job), JobState::Running);
    (h, job, workers)
}
