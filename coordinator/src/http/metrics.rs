//! The coordinator's Prometheus page (`GET /metrics`): jobs by state, workers, and per job
//! its progress, as the machine holds them at the time of the scrape.
//!
//! Names follow Prometheus conventions: the `keel_` prefix, base units (seconds, ratios),
//! counters ending in `_total`. A job is labelled `job_id` (not `job`, which Prometheus
//! gives every target itself). A value not known yet (a NaN loss before the first step) is
//! left out rather than written as `NaN`. The names are listed in
//! `deploy/grafana/metric-names.txt`, which the Grafana dashboard is checked against.

use crate::machine::Machine;
use keel_proto::protocol::HEARTBEAT_TIMEOUT;
use keel_proto::rpc::{JobState, JobStatus};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

/// Every job state, in the order of `keel_jobs` lines.
pub const STATES: [JobState; 8] = [
    JobState::Queued,
    JobState::Preparing,
    JobState::WaitingForWorkers,
    JobState::Running,
    JobState::Recovering,
    JobState::Completed,
    JobState::Failed,
    JobState::Cancelled,
];

/// `running` for `JobState::Running`: the label value and the JSON API's name of a state.
pub fn state_name(state: JobState) -> String {
    state
        .as_str_name()
        .trim_start_matches("JOB_STATE_")
        .to_ascii_lowercase()
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobLabels {
    job_id: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InfoLabels {
    job_id: String,
    state: String,
    precision: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// The per-job gauges, by metric name (without the `keel_job_` prefix) and help.
const JOB_GAUGES: [(&str, &str); 11] = [
    ("step", "Steps completed"),
    ("max_steps", "Steps the job runs in all"),
    ("loss", "Latest training loss (MLM + NSP), nats"),
    ("learning_rate", "Latest learning rate"),
    (
        "tokens_per_second",
        "Latest step's tokens per second, whole ring",
    ),
    ("step_seconds", "Latest step's wall time, seconds"),
    (
        "generation",
        "Membership generation (raised by every re-formed ring)",
    ),
    ("ring_workers", "Workers in the job's current ring"),
    ("eval_loss", "Latest held-out MLM loss, nats"),
    (
        "eval_accuracy_ratio",
        "Latest held-out MLM accuracy, 0 to 1",
    ),
    (
        "elapsed_seconds",
        "Seconds from the job's submission to now, or to its end once finished",
    ),
];

/// The values of [`JOB_GAUGES`] for one job, in that order (NaN: not known, left out).
fn job_values(status: &JobStatus) -> [f64; 11] {
    [
        status.step as f64,
        status.max_steps as f64,
        status.loss,
        status.learning_rate,
        status.tokens_per_second,
        status.step_seconds,
        status.generation as f64,
        status.workers.len() as f64,
        status.eval_loss,
        status.eval_accuracy,
        status.elapsed_seconds,
    ]
}

/// The page for `machine` at `now`: Prometheus text exposition format 0.0.4.
pub fn encode(machine: &Machine, now: Instant) -> String {
    let mut registry = Registry::with_prefix("keel");
    let statuses: Vec<JobStatus> = machine.jobs().map(|j| j.status(now)).collect();

    let by_state = Family::<StateLabels, Gauge>::default();
    for state in STATES {
        let n = statuses.iter().filter(|s| s.state() == state).count();
        by_state
            .get_or_create(&StateLabels {
                state: state_name(state),
            })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    registry.register("jobs", "Jobs by state", by_state);

    let registered = Gauge::<i64>::default();
    let alive = Gauge::<i64>::default();
    let workers: Vec<_> = machine.workers().collect();
    registered.set(i64::try_from(workers.len()).unwrap_or(i64::MAX));
    let live = workers
        .iter()
        .filter(|w| {
            w.reachable() && now.saturating_duration_since(w.last_seen()) < HEARTBEAT_TIMEOUT
        })
        .count();
    alive.set(i64::try_from(live).unwrap_or(i64::MAX));
    registry.register("workers_registered", "Workers registered", registered);
    registry.register(
        "workers_alive",
        "Registered workers attached and heard from within the heartbeat timeout",
        alive,
    );

    let info = Family::<InfoLabels, Gauge>::default();
    let gauges: Vec<Family<JobLabels, FloatGauge>> =
        JOB_GAUGES.iter().map(|_| Family::default()).collect();
    let recoveries = Family::<JobLabels, Counter>::default();
    let skipped = Family::<JobLabels, Counter>::default();
    let checkpoint_failures = Family::<JobLabels, Counter>::default();
    for status in &statuses {
        let job = JobLabels {
            job_id: status.job_id.clone(),
        };
        info.get_or_create(&InfoLabels {
            job_id: status.job_id.clone(),
            state: state_name(status.state()),
            precision: status.precision.clone(),
        })
        .set(1);
        for (family, value) in gauges.iter().zip(job_values(status)) {
            if value.is_finite() {
                family.get_or_create(&job).set(value);
            }
        }
        recoveries.get_or_create(&job).inc_by(status.recoveries);
        skipped.get_or_create(&job).inc_by(status.skipped_steps);
        checkpoint_failures
            .get_or_create(&job)
            .inc_by(status.checkpoint_failures);
    }
    registry.register("job_info", "A job's state and GEMM precision (1)", info);
    for ((name, help), family) in JOB_GAUGES.iter().zip(gauges) {
        registry.register(format!("job_{name}"), *help, family);
    }
    registry.register(
        "job_recoveries",
        "Times the job's ring was re-formed after a loss",
        recoveries,
    );
    registry.register(
        "job_skipped_steps",
        "Steps whose update was skipped (non-finite loss or gradient)",
        skipped,
    );
    registry.register(
        "job_checkpoint_upload_failures",
        "Checkpoint uploads the coordinator could not store (a full data folder, a broken \
         stream)",
        checkpoint_failures,
    );
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_names_are_the_lower_case_proto_names() {
        assert_eq!(
            state_name(JobState::WaitingForWorkers),
            "waiting_for_workers"
        );
        assert_eq!(state_name(JobState::Running), "running");
    }

    #[test]
    fn an_empty_coordinator_lists_every_state_at_zero() {
        let machine = Machine::new(std::path::PathBuf::from("/nonexistent"));
        let page = encode(&machine, Instant::now());
        for state in STATES {
            let line = format!("keel_jobs{{state=\"{}\"}} 0\n", state_name(state));
            assert!(page.contains(&line), "{line:?} missing from\n{page}");
        }
        assert!(page.contains("keel_workers_registered 0\n"), "{page}");
        assert!(page.contains("keel_workers_alive 0\n"), "{page}");
        assert!(page.ends_with("# EOF\n"), "{page}");
    }
}
