//! Whether a job's model can be trained by the workers that have registered: its size caps and
//! its estimated training memory ([`keel_proto::memory::estimate`]) against the memory limit
//! each worker advertised at registration.
//!
//! Checked three times, each as early as what it needs is known:
//! 1. at submission ([`check_submission`]), when the spec names the config (a file, or a preset
//!    with `data.vocab_size`): overflowing or capped sizes are refused naming the field, and a
//!    model no registered worker can hold is refused;
//! 2. after preparation (`prepare_job::finish`, with the real vocabulary), the estimate is
//!    stored with the prepared job;
//! 3. at assignment ([`fits`], [`no_worker_can_hold`]): only workers whose limit holds the
//!    estimate are given the job, and a job larger than every registered worker fails with the
//!    reason instead of crash-looping them.

use crate::CoordinatorError;
use keel_proto::config::BertConfig;
use keel_proto::jobspec::{JobSpec, ModelSource, Vocabulary};
use keel_proto::memory::{MemoryEstimate, estimate_job, format_bytes};

/// The estimate for `config` with the spec's micro-batch at its `max_seq_length`: the largest
/// over the job's phases; with `train.shard_optimizer`, for a rank of `cluster.min_workers`
/// sharing the moments.
///
/// Errors: [`CoordinatorError::BadRequest`] naming the field that is over its cap or
/// overflows, prefixed by `origin` (where the config came from).
pub fn estimate_for(
    config: &BertConfig,
    spec: &JobSpec,
    origin: &str,
) -> Result<MemoryEstimate, CoordinatorError> {
    let bad =
        |e: keel_proto::config::ConfigError| CoordinatorError::BadRequest(format!("{origin}: {e}"));
    config.validate().map_err(bad)?;
    estimate_job(config, spec).map_err(bad)
}

/// Submit-time check: when the spec's model config is known before preparation (a
/// `model.config` file, an `init_checkpoint`'s `config.json`, or a preset with
/// `data.vocab_size`), its sizes are within the caps, its estimate does not overflow, and
/// some registered worker can hold it (skipped while none has advertised a limit).
///
/// Errors: [`CoordinatorError::BadRequest`] naming the field or the estimate and the largest
/// limit; a config file that cannot be read within bounds (not a regular file, over 1 MiB).
pub fn check_submission(
    spec: &JobSpec,
    limits: impl Iterator<Item = Option<u64>> + Clone,
) -> Result<(), CoordinatorError> {
    let (config, origin) = match (&spec.model.source, &spec.data.vocabulary) {
        (ModelSource::Preset(preset), Vocabulary::Train { vocab_size }) => {
            let config = BertConfig::preset(preset, *vocab_size)
                .map_err(|e| CoordinatorError::BadRequest(format!("model.preset: {e}")))?;
            (config, "model.preset".to_string())
        }
        // The vocabulary comes from a file: its size is known after preparation.
        (ModelSource::Preset(_), Vocabulary::File(_)) => return Ok(()),
        (ModelSource::Config(path), _) => {
            let config = BertConfig::from_json_file(path)
                .map_err(|e| CoordinatorError::BadRequest(format!("model.config: {e}")))?;
            (config, format!("model.config {}", path.display()))
        }
        (ModelSource::InitCheckpoint(dir), _) => {
            let path = dir.join("config.json");
            let config = BertConfig::from_json_file(&path)
                .map_err(|e| CoordinatorError::BadRequest(format!("model.init_checkpoint: {e}")))?;
            (config, format!("model.init_checkpoint {}", path.display()))
        }
    };
    let estimate = estimate_for(&config, spec, &origin)?;
    if let Some(message) = no_worker_can_hold(limits, estimate.total_bytes) {
        return Err(CoordinatorError::BadRequest(format!("{origin}: {message}")));
    }
    Ok(())
}

/// Whether a worker with memory `limit` can hold a job needing `needed` bytes (a worker that
/// advertised no limit, being older than the field, is taken at its word).
pub fn fits(limit: Option<u64>, needed: Option<u64>) -> bool {
    match (limit, needed) {
        (Some(limit), Some(needed)) => needed <= limit,
        _ => true,
    }
}

/// A message saying why no registered worker (with memory `limits`, one per worker) can hold
/// `needed` bytes, or `None` when one can (or none has registered, or some advertised no
/// limit).
pub fn no_worker_can_hold(
    limits: impl Iterator<Item = Option<u64>> + Clone,
    needed: u64,
) -> Option<String> {
    let mut largest: Option<u64> = None;
    let count = limits.clone().count();
    for limit in limits {
        match limit {
            None => return None,
            Some(limit) if limit >= needed => return None,
            Some(limit) => largest = Some(largest.map_or(limit, |l| l.max(limit))),
        }
    }
    let largest = largest?;
    Some(format!(
        "training this model needs an estimated {} (weights, gradients, 2 optimizer moments and \
         the activations of one micro-batch at max_seq_length) but the largest memory limit of \
         the {} registered worker(s) is {}: reduce hidden_size, num_hidden_layers, vocab_size, \
         train.micro_batch_size or data.max_seq_length",
        format_bytes(needed),
        count,
        format_bytes(largest)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(extra_train: &str, min_workers: usize) -> JobSpec {
        let text = format!(
            "[data]\ncorpus = [\"/corpus.txt\"]\nvocab_size = 1000\nmax_seq_length = 128\n\
             [model]\npreset = \"mini\"\n[train]\nmicro_batch_size = 8\nmax_steps = 10\n\
             {extra_train}\n[cluster]\nmin_workers = {min_workers}\nmax_workers = 4\n"
        );
        JobSpec::from_toml_str(&text, "job.toml").unwrap()
    }

    #[test]
    fn a_sharded_optimizer_is_estimated_for_a_rank_of_the_smallest_world() {
        let config = BertConfig::preset("mini", 1000).unwrap();
        let whole = estimate_for(&config, &spec("", 2), "test").unwrap();
        let sharded = estimate_for(&config, &spec("shard_optimizer = true", 2), "test").unwrap();
        // Each of 2 ranks keeps half of the 8 bytes per parameter of the moments.
        assert_eq!(whole.total_bytes - sharded.total_bytes, 4 * whole.params);
        // One worker may run it alone: nothing is shared then.
        let alone = estimate_for(&config, &spec("shard_optimizer = true", 1), "test").unwrap();
        assert_eq!(alone, whole);
    }
}
