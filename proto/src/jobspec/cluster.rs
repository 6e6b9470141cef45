//! `[cluster]`: how many workers, and when a loss or a stall ends the job.

use super::error::SpecError;
use serde::{Deserialize, Serialize};

/// `[cluster]`: world size bounds and failure detection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// The job starts once this many workers are free, and fails below it.
    #[serde(default = "default_one")]
    pub min_workers: usize,
    /// At most this many workers take part.
    #[serde(default = "default_one")]
    pub max_workers: usize,
    /// A peer silent for this long (seconds) is declared dead.
    #[serde(default = "default_peer_timeout")]
    pub peer_timeout_seconds: f64,
    /// Times the ring may be re-formed after losing a worker (or the coordinator) before the
    /// job fails; 0 = fail at the first loss.
    #[serde(default = "default_max_recoveries")]
    pub max_recoveries: u64,
    /// After a loss leaves fewer than `min_workers`, wait this long (seconds) for a
    /// replacement before failing the job.
    #[serde(default = "default_replacement_timeout")]
    pub replacement_timeout_seconds: f64,
    /// A running job whose step does not advance for this long (seconds) is stalled: the
    /// coordinator names the workers that have not reported the next step and re-forms the
    /// ring without those it can single out (a recovery, counted against `max_recoveries`),
    /// or fails the job. It must cover the longest gap between two steps: the first step of a
    /// generation (fetching the data, a state broadcast), an evaluation, checkpoint staging.
    #[serde(default = "default_progress_timeout")]
    pub progress_timeout_seconds: f64,
}

impl Default for ClusterSpec {
    fn default() -> Self {
        ClusterSpec {
            min_workers: 1,
            max_workers: 1,
            peer_timeout_seconds: default_peer_timeout(),
            max_recoveries: default_max_recoveries(),
            replacement_timeout_seconds: default_replacement_timeout(),
            progress_timeout_seconds: default_progress_timeout(),
        }
    }
}

fn default_one() -> usize {
    1
}
fn default_peer_timeout() -> f64 {
    30.0
}
fn default_max_recoveries() -> u64 {
    16
}
fn default_replacement_timeout() -> f64 {
    600.0
}
/// Ten minutes: the first step of a large model after fetching its shards over a slow link,
/// or a long evaluation, fits; a job stuck at one step is noticed the same hour.
fn default_progress_timeout() -> f64 {
    600.0
}

impl ClusterSpec {
    /// Checks every `[cluster]` value.
    ///
    /// Errors: the first [`SpecError`], naming the key.
    pub fn validate(&self) -> Result<(), SpecError> {
        let c = self;
        if c.min_workers == 0 {
            return Err(SpecError::new(
                "cluster.min_workers",
                "0",
                "at least 1 worker",
            ));
        }
        if c.max_workers < c.min_workers || c.max_workers > 4096 {
            return Err(SpecError::new(
                "cluster.max_workers",
                c.max_workers.to_string(),
                "at least cluster.min_workers and at most 4096",
            ));
        }
        if !(c.peer_timeout_seconds.is_finite() && (0.5..=3600.0).contains(&c.peer_timeout_seconds))
        {
            return Err(SpecError::new(
                "cluster.peer_timeout_seconds",
                c.peer_timeout_seconds.to_string(),
                "between 0.5 and 3600 seconds",
            ));
        }
        for (key, v) in [
            (
                "cluster.replacement_timeout_seconds",
                c.replacement_timeout_seconds,
            ),
            (
                "cluster.progress_timeout_seconds",
                c.progress_timeout_seconds,
            ),
        ] {
            if !(v.is_finite() && (1.0..=604_800.0).contains(&v)) {
                return Err(SpecError::new(
                    key,
                    v.to_string(),
                    "between 1 second and 604800 (one week)",
                ));
            }
        }
        Ok(())
    }
}
