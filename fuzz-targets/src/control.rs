//! `control_request`: coordinator request messages decoded with prost and applied as
//! `CoordinatorService` applies them (the same checks, then the state machine's input), to one
//! [`Machine`], in order.
//!
//! What needs a running server is left out: the service's async plumbing (`Shared`, the
//! driver's lock, `spawn_blocking`), making the job's folder, and carrying out the machine's
//! effects (preparation, file transfers). Streams (`UploadCheckpoint`, `Attach`) are not
//! decoded here.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Instant, SystemTime};

use keel_coordinator::input_roots::InputRoots;
use keel_coordinator::machine::{Input, Machine, Registration, Reply, StepTimes};
use keel_proto::jobspec::JobSpec;
use keel_proto::rpc::{
    CancelJobRequest, DoneReport, EvalReport, FailureReport, FetchFileRequest, GetJobRequest,
    HeartbeatRequest, HeldReport, PullCheckpointRequest, RegisterRequest, StepReport,
    SubmitJobRequest,
};
use prost::Message;

/// Bytes of a submitted job's origin kept (as the service keeps them).
const MAX_ORIGIN_BYTES: usize = 256;

/// Messages applied per input, at most.
const MAX_MESSAGES: usize = 64;

/// The input root of the fuzzed coordinator: a fixed folder under the system's temporary
/// folder holding one corpus file ([`CORPUS_FILE`]), so that a submitted job naming it passes
/// the submit check (the seeds do) and every other path is refused before the disk is walked.
pub fn input_root() -> PathBuf {
    std::env::temp_dir().join("keel-fuzz-input-root")
}

/// The corpus file in [`input_root`].
pub const CORPUS_FILE: &str = "corpus.txt";

/// The coordinator's input roots ([`input_root`], made once per process).
fn roots() -> &'static (InputRoots, PathBuf) {
    static ROOTS: OnceLock<(InputRoots, PathBuf)> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let root = input_root();
        std::fs::create_dir_all(&root).expect("the input root");
        let corpus = root.join(CORPUS_FILE);
        if !corpus.is_file() {
            std::fs::write(&corpus, "In the beginning.\nAnd the earth.\n")
                .expect("the input root's corpus");
        }
        let roots = InputRoots::new(std::slice::from_ref(&root)).expect("an input root");
        (roots, root)
    })
}

/// Which message a record holds (its first byte, modulo the count).
const KINDS: u8 = 12;

/// A sequence of records, each a kind byte, a length (u16, little-endian) and that many bytes of
/// a protobuf message of that kind (cut to what is there):
/// 0 `SubmitJob`, 1 `Register`, 2 `Heartbeat`, 3 `ReportStep`, 4 `ReportEval`, 5 `ReportDone`,
/// 6 `ReportFailure`, 7 `ReportHeld`, 8 `CancelJob`, 9 `GetJob`, 10 `PullCheckpoint`'s job
/// and step lookup, 11 `FetchFile`'s lookup; a time tick after each.
pub fn control_request(data: &[u8]) {
    let _ = apply_all(data);
}

/// [`control_request`], returning the machine the requests were applied to.
fn apply_all(data: &[u8]) -> Machine {
    // The machine never touches its jobs folder (its effects are not carried out here).
    let (_, root) = roots();
    let mut machine = Machine::new(root.join("jobs"));
    let mut rest = data;
    for _ in 0..MAX_MESSAGES {
        if rest.len() < 3 {
            break;
        }
        let kind = rest[0] % KINDS;
        let len = usize::from(u16::from_le_bytes([rest[1], rest[2]]));
        let body = &rest[3..];
        let (message, after) = body.split_at(len.min(body.len()));
        rest = after;
        apply(&mut machine, kind, message);
        let _ = machine.step(Instant::now(), Input::Tick);
        let _ = machine.take_effects();
    }
    // Every answer the service gives from the state must still be computable.
    let now = Instant::now();
    for job in machine.jobs() {
        let _ = job.status(now);
    }
    machine
}

/// Decodes `bytes` as message `kind` and applies it as the service does; errors are answers.
fn apply(machine: &mut Machine, kind: u8, bytes: &[u8]) {
    let now = Instant::now();
    match kind {
        0 => {
            let Ok(req) = SubmitJobRequest::decode(bytes) else {
                return;
            };
            let origin = if req.origin.is_empty() {
                "job".to_string()
            } else {
                keel_proto::quote::bounded(&req.origin, MAX_ORIGIN_BYTES)
            };
            let Ok(spec) = JobSpec::from_toml_str(&req.spec_toml, &origin) else {
                return;
            };
            let (roots, _) = roots();
            if keel_coordinator::submit_check::check_job(&spec, &origin, roots).is_err() {
                return;
            }
            if let Ok(Reply::Reserved { id, dir }) =
                machine.step(now, Input::Reserve { spec: spec.clone() })
            {
                let _ = machine.step(
                    now,
                    Input::Submitted {
                        id,
                        spec,
                        dir,
                        wall: SystemTime::now(),
                    },
                );
            }
        }
        1 => {
            let Ok(req) = RegisterRequest::decode(bytes) else {
                return;
            };
            if req.advertise_addr.is_empty() {
                return;
            }
            let registration = Registration {
                advertise_addr: req.advertise_addr,
                threads: req.threads,
                bf16_native: req.bf16_native,
                bf16_detail: req.bf16_detail,
                hostname: req.hostname,
                holds: req.held,
                memory_limit: req.memory_limit_bytes,
            };
            if let Ok(Reply::Registered { worker_id }) =
                machine.step(now, Input::Register(registration))
            {
                // The worker attaches its command stream next, as a real one does.
                let _ = machine.step(
                    now,
                    Input::Attached {
                        worker_id,
                        attach: 1,
                    },
                );
            }
        }
        2 => {
            let Ok(req) = HeartbeatRequest::decode(bytes) else {
                return;
            };
            let _ = machine.step(
                now,
                Input::Heartbeat {
                    worker_id: req.worker_id,
                    key: req.key,
                    times: StepTimes::from_heartbeat(
                        req.last_step_seconds,
                        req.last_ring_wait_seconds,
                    ),
                },
            );
        }
        3 => {
            if let Ok(r) = StepReport::decode(bytes) {
                let _ = machine.step(now, Input::Step(r));
            }
        }
        4 => {
            if let Ok(r) = EvalReport::decode(bytes) {
                let _ = machine.step(now, Input::Eval(r));
            }
        }
        5 => {
            if let Ok(r) = DoneReport::decode(bytes) {
                let _ = machine.step(now, Input::Done(r));
            }
        }
        6 => {
            if let Ok(r) = FailureReport::decode(bytes) {
                let _ = machine.step(now, Input::Failure(r));
            }
        }
        7 => {
            if let Ok(r) = HeldReport::decode(bytes) {
                let _ = machine.step(now, Input::Held(r));
            }
        }
        8 => {
            if let Ok(r) = CancelJobRequest::decode(bytes) {
                let _ = machine.step(now, Input::Cancel { job_id: r.job_id });
            }
        }
        9 => {
            if let Ok(r) = GetJobRequest::decode(bytes)
                && let Ok(job) = machine.job(&r.job_id)
            {
                let _ = job.status(now);
            }
        }
        10 => {
            if let Ok(r) = PullCheckpointRequest::decode(bytes)
                && let Ok(job) = machine.job(&r.job_id)
            {
                let checkpoints = job.checkpoints();
                let _ = if r.step == 0 {
                    checkpoints.last().copied()
                } else {
                    checkpoints.contains(&r.step).then_some(r.step)
                };
            }
        }
        _ => {
            if let Ok(r) = FetchFileRequest::decode(bytes)
                && let Ok(job) = machine.current(r.key.as_ref())
            {
                let _ = job.file(&r.name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_seed_registers_workers_and_queues_a_job() {
        let path = format!(
            "{}/../fuzz/corpus/control_request/register-submit-report-cancel",
            env!("CARGO_MANIFEST_DIR")
        );
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let machine = apply_all(&data);
        assert_eq!(machine.workers().count(), 2);
        assert_eq!(machine.jobs().count(), 1, "the submitted job was refused");
    }
}
