//! Checkpoint staging: a replica's weights, optimizer state and `trainer_state.json` written
//! into a fresh folder under the work dir, for the reporter to upload (rank 0).

use super::error::{TrainError, io_err};
use super::optimizer::optimizer_name;
use super::setup::TrainSetup;
use crate::replica::Replica;
use keel_proto::checkpoint::{
    MODEL_FILE, OPTIMIZER_FILE, TRAINER_STATE_FILE, TrainerState, write_file_atomic,
};
use keel_proto::params::ParamLayout;
use std::path::PathBuf;

/// Writes `model.safetensors` (weights `[P]` over `layout`), the optimizer state (the
/// optimizer's own, or `gathered`: a sharded optimizer's buffers gathered to `[P]`, in its
/// `state()` order) and `trainer_state.json` (with `loss`, the step's mean loss in nats, NaN if none, and
/// `global_batch` sequences per step) into `work_dir/checkpoint-<step>`, replacing any older
/// folder of that name; returns the folder.
///
/// Errors: [`TrainError::Io`] when a weight is not finite (nothing is written) or a file
/// cannot be written.
pub fn stage_checkpoint(
    setup: &TrainSetup,
    layout: &ParamLayout,
    replica: &Replica,
    gathered: Option<&[(&'static str, Vec<f32>)]>,
    loss: f64,
    global_batch: u64,
) -> Result<PathBuf, TrainError> {
    let step = replica.step;
    if let Some(name) = first_non_finite(layout, &replica.params) {
        return Err(TrainError::Io {
            step,
            message: format!("refusing to checkpoint: {name} holds a non-finite value"),
        });
    }
    let io = io_err(step);
    let dir = setup.work_dir.join(format!("checkpoint-{step}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| io(format!("{}: {e}", dir.display())))?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| io(format!("{}: {e}", dir.display())))?;
    keel_proto::weights::save_safetensors(dir.join(MODEL_FILE), layout, &replica.params)
        .map_err(|e| io(format!("saving weights: {e}")))?;
    let kind = &setup.spec.train.optimizer;
    let path = dir.join(OPTIMIZER_FILE);
    match gathered {
        None => crate::optim_state::save(&path, replica.optimizer.as_ref(), kind),
        Some(buffers) => {
            let views: Vec<(&str, &[f32])> =
                buffers.iter().map(|(n, d)| (*n, d.as_slice())).collect();
            let steps = replica.optimizer.steps_taken();
            crate::optim_state::save_buffers(&path, steps, &views, kind)
        }
    }
    .map_err(|e| io(format!("saving optimizer state: {e}")))?;
    let state = TrainerState {
        step,
        job_id: setup.job_id.clone(),
        generation: setup.generation,
        seed: setup.spec.train.seed,
        world_size: setup.world_size,
        global_batch_size: global_batch,
        sequences_seen: step * global_batch,
        loss,
        optimizer: optimizer_name(&setup.spec.train.optimizer).into(),
        skipped_steps: replica.skipped_steps,
        precision: setup.precision,
    };
    let text = serde_json::to_string_pretty(&state).map_err(|e| io(e.to_string()))?;
    write_file_atomic(&dir.join(TRAINER_STATE_FILE), text.as_bytes())
        .map_err(|e| io(e.to_string()))?;
    Ok(dir)
}

/// The name of the first parameter tensor of `layout` holding a NaN or an infinity in
/// `params` (`[P]`), if any.
pub fn first_non_finite(layout: &ParamLayout, params: &[f32]) -> Option<String> {
    layout
        .entries()
        .iter()
        .find(|e| {
            params
                .get(e.range())
                .is_some_and(|p| p.iter().any(|x| !x.is_finite()))
        })
        .map(|e| e.name.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_non_finite_tensor_is_named() {
        let config = keel_proto::config::BertConfig::preset("tiny", 1000).unwrap();
        let layout = ParamLayout::bert(&config, config.heads());
        let mut params = vec![0.5f32; layout.total_len()];
        assert_eq!(first_non_finite(&layout, &params), None);
        let entries = layout.entries();
        let (a, b) = (&entries[3], &entries[7]);
        params[b.range().start] = f32::INFINITY;
        params[a.range().end - 1] = f32::NAN;
        assert_eq!(first_non_finite(&layout, &params), Some(a.name.clone()));
    }
}
