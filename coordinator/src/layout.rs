//! Where a job's files live in its folder (`DATA_DIR/jobs/job-N/`).

use std::path::{Path, PathBuf};

/// The folder of the checkpoint at `step` of the job in `job_dir`.
pub fn checkpoint_dir(job_dir: &Path, step: u64) -> PathBuf {
    job_dir.join("checkpoints").join(format!("step-{step}"))
}
