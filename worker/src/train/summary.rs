//! A rank's totals over a generation, logged when its steps end: mean step and optimizer time,
//! the optimizer state it holds and the process's peak memory. What `scripts/bench-shard.sh`
//! reads to compare `train.shard_optimizer` with the unsharded optimizer, per rank.

use std::time::Duration;

/// Sums over the steps of a generation after its first (which warms caches and buffers up).
#[derive(Debug, Default)]
pub struct RankTotals {
    /// Steps run in this generation, the first included.
    seen: u64,
    /// Steps summed (all but the first).
    steps: u64,
    /// Wall time of the summed steps, seconds.
    step_s: f64,
    /// Clipping and the update (the sharded norms' all-reduces included), seconds.
    optimizer_s: f64,
    /// The updated weights' all-gather (`train.shard_optimizer`), seconds.
    gather_s: f64,
}

impl RankTotals {
    /// Adds a step of `step` wall time, of which `optimizer` was the update phase (with
    /// `gather` of it spent in the weights' all-gather).
    pub fn add(&mut self, step: Duration, optimizer: Duration, gather: Duration) {
        self.seen += 1;
        if self.seen == 1 {
            return;
        }
        self.steps += 1;
        self.step_s += step.as_secs_f64();
        self.optimizer_s += (optimizer.saturating_sub(gather)).as_secs_f64();
        self.gather_s += gather.as_secs_f64();
    }

    /// Logs the means (milliseconds), `state_bytes` of optimizer state on this rank, and the
    /// process's peak resident memory (`VmHWM`, MiB), at info level.
    pub fn log(&self, job: &str, rank: u32, sharded: bool, state_bytes: usize) {
        let per_step = |s: f64| s * 1e3 / self.steps.max(1) as f64;
        tracing::info!(
            job,
            rank,
            sharded,
            steps = self.steps,
            mean_step_ms = format!("{:.1}", per_step(self.step_s)),
            mean_optimizer_ms = format!("{:.2}", per_step(self.optimizer_s)),
            mean_weight_gather_ms = format!("{:.2}", per_step(self.gather_s)),
            optimizer_state_mib = format!("{:.1}", state_bytes as f64 / (1u64 << 20) as f64),
            peak_rss_mib = format!("{:.1}", peak_rss_mib().unwrap_or(f64::NAN)),
            "rank summary (steps after the generation's first)"
        );
    }
}

/// This process's peak resident set size, MiB (`VmHWM` of `/proc/self/status`), if known.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_step_is_left_out_and_the_gather_is_not_the_optimizers() {
        let mut t = RankTotals::default();
        let ms = Duration::from_millis;
        t.add(ms(1000), ms(500), ms(0));
        t.add(ms(100), ms(30), ms(10));
        t.add(ms(300), ms(50), ms(30));
        assert_eq!(t.steps, 2);
        assert!((t.step_s - 0.4).abs() < 1e-9);
        assert!((t.optimizer_s - 0.04).abs() < 1e-9);
        assert!((t.gather_s - 0.04).abs() < 1e-9);
        assert!(peak_rss_mib().is_some_and(|m| m > 0.0));
    }
}
