//! What a worker claims about a job, checked against the job before it is trusted.

/// The newest of the steps `held_steps` that `worker` says it holds that the job can have: a claim
/// past the job's last step (`train.max_steps`; e.g. 2^64-1) cannot be a replica of it and is
/// ignored with a warning, so the job never "resumes" from it. The bound is the job's last
/// step rather than its last reported one: step reports queue behind checkpoint uploads and
/// the saved step lags after a restart, so an honest replica may be ahead of both.
pub fn trusted_newest(worker: &str, held_steps: &[u64], max_steps: u64) -> Option<u64> {
    let (trusted, refused): (Vec<u64>, Vec<u64>) =
        held_steps.iter().partition(|&&s| s <= max_steps);
    if !refused.is_empty() {
        tracing::warn!(
            worker = ?worker,
            claimed = ?refused,
            max_steps,
            "held-step claim past the job's last step ignored"
        );
    }
    trusted.into_iter().max()
}
