//! `optimizer.safetensors`: the optimizer's state buffers, each one flat F32 tensor
//! `[total_len]` in the parameter layout (HF state-dict order), named as the optimizer names
//! them (`exp_avg`, `exp_avg_sq`), with `steps_taken` and the optimizer's name in the metadata
//! (key `keel`, a JSON object).

use crate::optim::Optimizer;
use keel_proto::jobspec::OptimizerKind;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::Path;

/// Errors writing optimizer state.
#[derive(Debug, thiserror::Error)]
pub enum OptimStateError {
    /// Serialisation failed.
    #[error("serialising optimizer state: {0}")]
    Format(String),
    /// The file could not be written.
    #[error(transparent)]
    Io(#[from] keel_proto::checkpoint::CheckpointError),
}

/// Writes the optimizer's state to `path` atomically.
///
/// Errors: [`OptimStateError`].
pub fn save(
    path: &Path,
    optimizer: &dyn Optimizer,
    kind: &OptimizerKind,
) -> Result<(), OptimStateError> {
    let state = optimizer.state();
    let bytes: Vec<(String, Vec<u8>, usize)> = state
        .iter()
        .map(|(name, data)| {
            let raw: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
            (name.to_string(), raw, data.len())
        })
        .collect();
    let mut views = Vec::with_capacity(bytes.len());
    for (name, raw, len) in &bytes {
        let view = TensorView::new(Dtype::F32, vec![*len], raw)
            .map_err(|e| OptimStateError::Format(format!("{name}: {e}")))?;
        views.push((name.clone(), view));
    }
    // One metadata key: safetensors writes its metadata map in hash order, and checkpoints
    // must be bit-identical from run to run.
    let name = match kind {
        OptimizerKind::Adamw => "adamw",
        OptimizerKind::Lamb => "lamb",
    };
    let info = format!(
        r#"{{"optimizer":"{name}","steps_taken":{},"layout":"flat, HF state-dict order"}}"#,
        optimizer.steps_taken()
    );
    let metadata = HashMap::from([("keel".to_string(), info)]);
    let out = safetensors::serialize(views, Some(metadata))
        .map_err(|e| OptimStateError::Format(e.to_string()))?;
    keel_proto::checkpoint::write_file_atomic(path, &out)?;
    Ok(())
}
