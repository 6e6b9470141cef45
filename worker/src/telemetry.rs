//! What a worker process measures about itself, for its Prometheus `/metrics` page
//! (`--metrics-listen`) and its heartbeats (the coordinator's dashboard shows each worker's
//! last step time and ring wait).
//!
//! One set per process, in a `static`, like the GEMM counters in `model::gemm`: the trainer,
//! the ring link and the HTTP port update and read it without passing it through every layer.
//!
//! # Metrics (Prometheus names; seconds and bytes, counters end in `_total`)
//! - `keel_worker_job_info{job_id,rank}` 1 while a job has run a step here.
//! - `keel_worker_step` (steps the current job has completed here), `keel_worker_steps_total`.
//! - `keel_worker_step_seconds_total{phase}` and `keel_worker_last_step_seconds{phase}`, phase
//!   `compute` (forward and backward of every micro-batch), `ring_wait` (from the end of the
//!   backward pass until the summed gradient and loss are back: the all-reduce time the
//!   backward pass did not hide), `optimizer` (clipping and the AdamW/LAMB update), `other`
//!   (input batches, the all-reduce of counts, reporting); the phases sum to the step, whose
//!   wall time is `keel_worker_last_step_duration_seconds` (a metric of its own, so that a
//!   `sum` over the phases counts the step once).
//! - `keel_worker_allreduce_bytes_total`: bytes this worker sent on the ring (frames as
//!   encoded, headers included); `keel_worker_allreduce_seconds_total`: time the ring spent in
//!   all-reduces (overlapping the backward pass).
//! - `keel_worker_gemm_seconds_total`: wall time inside GEMM calls (`model::gemm::stats`);
//!   the GEMM share of a step is its rate over the rate of the summed step seconds.
//! - `keel_worker_resident_memory_bytes` (`/proc/self/statm`), `keel_worker_shard_cache_bytes`
//!   (files fetched into `CACHE_DIR/files`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::Duration;

/// The phases of a step, as `phase` label values.
pub const PHASES: [&str; 4] = ["compute", "ring_wait", "optimizer", "other"];

type SecondsCounter = Counter<f64, AtomicU64>;
type SecondsGauge = Gauge<f64, AtomicU64>;

/// Labels of the per-phase metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
}

/// Labels of `keel_worker_job_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobLabels {
    job_id: String,
    rank: String,
}

/// How one finished step's wall time divides (seconds each).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTimes {
    /// The whole step, from taking its batches to its report.
    pub total: f64,
    /// Forward and backward of every micro-batch.
    pub compute: f64,
    /// After the backward pass, waiting for the summed gradient and loss.
    pub ring_wait: f64,
    /// Clipping and the optimizer update.
    pub optimizer: f64,
}

impl StepTimes {
    /// The rest of the step (input, counts all-reduce, report), never negative.
    pub fn other(&self) -> f64 {
        (self.total - self.compute - self.ring_wait - self.optimizer).max(0.0)
    }
}

/// A set of worker metrics (the process's is a `static`; tests make their own).
#[derive(Debug, Default)]
pub struct WorkerMetrics {
    steps: Counter,
    step: Gauge,
    phase_seconds: Family<PhaseLabels, SecondsCounter>,
    last_step: Family<PhaseLabels, SecondsGauge>,
    last_step_total: SecondsGauge,
    allreduce_bytes: Counter,
    allreduce_seconds: SecondsCounter,
    job: Family<JobLabels, Gauge>,
    /// The last step's times, for heartbeats (`None` before the first step).
    last: Mutex<Option<StepTimes>>,
}

static METRICS: LazyLock<WorkerMetrics> = LazyLock::new(WorkerMetrics::default);

/// Records a finished step in the process's metrics (see [`WorkerMetrics::record_step`]).
pub fn record_step(job: &str, rank: u32, steps_done: u64, times: StepTimes) {
    METRICS.record_step(job, rank, steps_done, times);
}

/// The process's metrics page (see [`WorkerMetrics::encode`]).
pub fn encode(cache_dir: &Path) -> String {
    METRICS.encode(cache_dir)
}

impl WorkerMetrics {
    /// Records a finished step: `steps_done` steps of `job` are now completed at `rank`.
    pub fn record_step(&self, job: &str, rank: u32, steps_done: u64, times: StepTimes) {
        let m = self;
        let labels = JobLabels {
            job_id: job.to_string(),
            rank: rank.to_string(),
        };
        if m.job.get_or_create(&labels).get() != 1 {
            // A new job (or rank): only the current one is listed.
            m.job.clear();
            m.job.get_or_create(&labels).set(1);
        }
        m.steps.inc();
        m.step.set(i64::try_from(steps_done).unwrap_or(i64::MAX));
        let values = [
            times.compute,
            times.ring_wait,
            times.optimizer,
            times.other(),
        ];
        for (phase, seconds) in PHASES.iter().zip(values) {
            let labels = PhaseLabels {
                phase: (*phase).to_string(),
            };
            m.phase_seconds.get_or_create(&labels).inc_by(seconds);
            m.last_step.get_or_create(&labels).set(seconds);
        }
        m.last_step_total.set(times.total);
        *m.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(times);
    }

    /// The metrics page: Prometheus text exposition of everything above; `cache_dir` is the
    /// worker's `--cache-dir`.
    pub fn encode(&self, cache_dir: &Path) -> String {
        let m = self;
        let mut registry = Registry::with_prefix("keel_worker");
        registry.register(
            "job_info",
            "The job and rank this worker runs (1), since its first step",
            m.job.clone(),
        );
        registry.register(
            "step",
            "Steps of the current job completed here",
            m.step.clone(),
        );
        registry.register(
            "steps",
            "Training steps this process completed",
            m.steps.clone(),
        );
        registry.register(
            "step_seconds",
            "Step wall time by phase (compute, ring_wait, optimizer, other), seconds",
            m.phase_seconds.clone(),
        );
        registry.register(
            "last_step_seconds",
            "The last step's wall time by phase, seconds",
            m.last_step.clone(),
        );
        registry.register(
            "last_step_duration_seconds",
            "The last step's wall time, seconds",
            m.last_step_total.clone(),
        );
        registry.register(
            "allreduce_bytes",
            "Bytes sent to the right neighbour on the ring",
            m.allreduce_bytes.clone(),
        );
        registry.register(
            "allreduce_seconds",
            "Time the ring spent in all-reduces (overlaps the backward pass), seconds",
            m.allreduce_seconds.clone(),
        );
        let gemm = SecondsCounter::default();
        gemm.inc_by(crate::model::gemm::stats().seconds);
        registry.register("gemm_seconds", "Wall time inside GEMM calls, seconds", gemm);
        let rss = Gauge::<i64>::default();
        rss.set(i64::try_from(resident_bytes().unwrap_or(0)).unwrap_or(i64::MAX));
        registry.register(
            "resident_memory_bytes",
            "Resident set size of this process, bytes",
            rss,
        );
        let cache = Gauge::<i64>::default();
        cache.set(i64::try_from(cache_bytes(&cache_dir.join("files"))).unwrap_or(i64::MAX));
        registry.register(
            "shard_cache_bytes",
            "Bytes of the files (shards, vocabularies) cached from the coordinator",
            cache,
        );
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
        text
    }
}

/// Counts `bytes` sent to the right neighbour on the ring.
pub fn add_ring_bytes(bytes: usize) {
    METRICS.allreduce_bytes.inc_by(bytes as u64);
}

/// Counts `took` spent in one all-reduce.
pub fn add_allreduce_time(took: Duration) {
    METRICS.allreduce_seconds.inc_by(took.as_secs_f64());
}

/// The last step's times (`None` before the first step of this process).
pub fn last_step() -> Option<StepTimes> {
    *METRICS.last.lock().unwrap_or_else(PoisonError::into_inner)
}

/// This process's resident set size from `/proc/self/statm` (pages times the page size);
/// `None` where there is no such file.
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

/// Bytes of the regular files directly in `dir` (0 when it does not exist).
fn cache_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_is_the_rest_and_never_negative() {
        let t = StepTimes {
            total: 1.0,
            compute: 0.5,
            ring_wait: 0.2,
            optimizer: 0.1,
        };
        assert!((t.other() - 0.2).abs() < 1e-12);
        let over = StepTimes { total: 0.5, ..t };
        assert_eq!(over.other(), 0.0);
    }

    #[test]
    fn the_page_lists_every_metric_with_its_values() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("files")).expect("mkdir");
        std::fs::write(dir.path().join("files/a"), [0u8; 1000]).expect("write");
        let metrics = WorkerMetrics::default();
        metrics.record_step(
            "job-7",
            2,
            5,
            StepTimes {
                total: 0.4,
                compute: 0.25,
                ring_wait: 0.05,
                optimizer: 0.02,
            },
        );
        metrics.allreduce_bytes.inc_by(1234);
        let page = metrics.encode(dir.path());
        for needle in [
            "keel_worker_job_info{job_id=\"job-7\",rank=\"2\"} 1",
            "keel_worker_step 5",
            "keel_worker_last_step_duration_seconds 0.4",
            "keel_worker_last_step_seconds{phase=\"compute\"} 0.25",
            "keel_worker_shard_cache_bytes 1000",
            "# TYPE keel_worker_steps counter",
            "keel_worker_allreduce_bytes_total 1234",
            "keel_worker_gemm_seconds_total ",
            "keel_worker_resident_memory_bytes ",
        ] {
            assert!(page.contains(needle), "{needle:?} missing from\n{page}");
        }
        let last = *metrics.last.lock().expect("lock");
        assert_eq!(last.map(|t| t.compute), Some(0.25));
    }
}
