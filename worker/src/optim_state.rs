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
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not optimizer state for this optimizer and layout.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Writes the optimizer's state to `path` atomically.
///
/// Errors: [`OptimStateError`].
pub fn save(
    path: &Path,
    optimizer: &dyn Optimizer,
    kind: &OptimizerKind,
) -> Result<(), OptimStateError> {
    save_buffers(path, optimizer.steps_taken(), &optimizer.state(), kind)
}

/// Writes optimizer state given as named buffers (`[P]` each, in the parameter layout) and its
/// step count to `path` atomically: what [`save`] writes for an optimizer holding them (a
/// sharded optimizer's moments, gathered from every rank).
///
/// Errors: [`OptimStateError`].
pub fn save_buffers(
    path: &Path,
    steps_taken: u64,
    state: &[(&str, &[f32])],
    kind: &OptimizerKind,
) -> Result<(), OptimStateError> {
    let bytes: Vec<(String, Vec<u8>, usize)> = state
        .iter()
        .map(|(name, data)| {
            let raw = keel_proto::weights::f32_to_le_bytes(data);
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
        steps_taken
    );
    let metadata = HashMap::from([("keel".to_string(), info)]);
    let out = safetensors::serialize(views, Some(metadata))
        .map_err(|e| OptimStateError::Format(e.to_string()))?;
    keel_proto::checkpoint::write_file_atomic(path, &out)?;
    Ok(())
}

/// Reads `optimizer.safetensors` written by [`save`] into `optimizer` (a fresh one of the same
/// kind over the same layout): its buffers and `steps_taken`.
///
/// Errors: [`OptimStateError::Read`]; [`OptimStateError::Invalid`] naming what is wrong (not
/// safetensors, another optimizer, a missing buffer, a buffer of the wrong length or dtype).
pub fn load(
    path: &Path,
    optimizer: &mut dyn Optimizer,
    kind: &OptimizerKind,
) -> Result<(), OptimStateError> {
    let invalid = |message: String| OptimStateError::Invalid {
        path: path.to_path_buf(),
        message,
    };
    let bytes = std::fs::read(path).map_err(|source| OptimStateError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| invalid(format!("not a safetensors file: {e}")))?;
    let info = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("keel"))
        .ok_or_else(|| invalid("no `keel` metadata (not written by Keel)".into()))?;
    let info: serde_json::Value =
        serde_json::from_str(info).map_err(|e| invalid(format!("`keel` metadata: {e}")))?;
    let want = match kind {
        OptimizerKind::Adamw => "adamw",
        OptimizerKind::Lamb => "lamb",
    };
    let got = info.get("optimizer").and_then(|v| v.as_str()).unwrap_or("");
    if got != want {
        return Err(invalid(format!(
            "holds {got:?} state, the job's optimizer is {want:?}"
        )));
    }
    let steps_taken = info
        .get("steps_taken")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| invalid("`keel` metadata has no steps_taken".into()))?;
    let tensors = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| invalid(format!("not a safetensors file: {e}")))?;
    let mut buffers: Vec<(String, Vec<f32>)> = Vec::new();
    for (name, view) in tensors.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(invalid(format!(
                "tensor {name} is {:?}, expected F32",
                view.dtype()
            )));
        }
        let data = keel_proto::weights::f32_from_le_bytes(view.data());
        buffers.push((name, data));
    }
    let views: Vec<(&str, &[f32])> = buffers
        .iter()
        .map(|(n, d)| (n.as_str(), d.as_slice()))
        .collect();
    optimizer
        .load_state(steps_taken, &views)
        .map_err(|e| invalid(e.to_string()))
}
