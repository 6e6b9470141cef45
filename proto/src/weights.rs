//! `model.safetensors` in the layout HF's `save_pretrained` writes, to and from the flat buffer.
//!
//! # Layout
//! - [`save_safetensors`]: float32 tensors with HF names, metadata `{"format": "pt"}`, the tied
//!   `cls.predictions.decoder.{weight,bias}` left out (as `save_pretrained` does); written
//!   atomically (temp file in the same folder, fsync, rename).
//! - [`load_safetensors`] / [`load_safetensors_f64`]: every tensor of the layout must be present
//!   with its shape; the tied decoder tensors and `bert.embeddings.position_ids` may be present
//!   and are ignored; float32 and float64 files are read.
//! - [`load_tensors_f64`]: every tensor of a file by name (for tests and tools).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::params::ParamLayout;

/// Errors of reading or writing a safetensors file.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The bytes are not a valid safetensors file.
    #[error("{path}: not a valid safetensors file: {reason}")]
    Format {
        /// The file.
        path: String,
        /// The cause.
        reason: String,
    },
    /// A tensor of the layout is absent.
    #[error("{path}: tensor `{name}` is missing")]
    MissingTensor {
        /// The file.
        path: String,
        /// HF name of the tensor.
        name: String,
    },
    /// A tensor has the wrong shape.
    #[error("{path}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The file.
        path: String,
        /// HF name of the tensor.
        name: String,
        /// Shape the layout wants.
        expected: Vec<usize>,
        /// Shape in the file.
        got: Vec<usize>,
    },
    /// A tensor is stored in a dtype other than F32 or F64.
    #[error("{path}: tensor `{name}` has dtype {dtype}, expected F32 or F64")]
    UnsupportedDtype {
        /// The file.
        path: String,
        /// HF name of the tensor.
        name: String,
        /// The dtype found.
        dtype: String,
    },
    /// The buffer to save does not match the layout.
    #[error("parameter buffer has {got} elements, the layout {expected}")]
    LengthMismatch {
        /// `ParamLayout::total_len()`.
        expected: usize,
        /// Length of the buffer.
        got: usize,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> WeightsError + '_ {
    move |source| WeightsError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Reads a tensor's elements as f64 (F32 widened exactly).
fn tensor_f64(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Vec<f64>, WeightsError> {
    let data = view.data();
    match view.dtype() {
        Dtype::F32 => Ok(data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
            .collect()),
        Dtype::F64 => Ok(data
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .collect()),
        other => Err(WeightsError::UnsupportedDtype {
            path: path.display().to_string(),
            name: name.to_string(),
            dtype: format!("{other:?}"),
        }),
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>, WeightsError> {
    std::fs::read(path).map_err(io_err(path))
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>, WeightsError> {
    SafeTensors::deserialize(bytes).map_err(|e| WeightsError::Format {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// Loads the layout's tensors as f64 into a flat buffer of `layout.total_len()` elements.
fn load_flat_f64(path: &Path, layout: &ParamLayout) -> Result<Vec<f64>, WeightsError> {
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let mut flat = vec![0.0f64; layout.total_len()];
    for entry in layout.entries() {
        let view = st
            .tensor(&entry.name)
            .map_err(|_| WeightsError::MissingTensor {
                path: path.display().to_string(),
                name: entry.name.clone(),
            })?;
        if view.shape() != entry.shape.as_slice() {
            return Err(WeightsError::ShapeMismatch {
                path: path.display().to_string(),
                name: entry.name.clone(),
                expected: entry.shape.clone(),
                got: view.shape().to_vec(),
            });
        }
        let values = tensor_f64(path, &entry.name, &view)?;
        flat[entry.range()].copy_from_slice(&values);
    }
    Ok(flat)
}

/// Loads `model.safetensors` (F32 or F64 tensors) into a flat f32 buffer laid out as `layout`
/// (`layout.total_len()` elements). Tied decoder tensors and `bert.embeddings.position_ids`
/// may be present or absent; other extra tensors are ignored.
///
/// Errors: [`WeightsError::Io`], [`WeightsError::Format`], [`WeightsError::MissingTensor`],
/// [`WeightsError::ShapeMismatch`], [`WeightsError::UnsupportedDtype`], each naming the file
/// and tensor.
pub fn load_safetensors(
    path: impl AsRef<Path>,
    layout: &ParamLayout,
) -> Result<Vec<f32>, WeightsError> {
    Ok(load_flat_f64(path.as_ref(), layout)?
        .into_iter()
        .map(|v| v as f32)
        .collect())
}

/// As [`load_safetensors`], into an f64 buffer (F32 values widened exactly).
pub fn load_safetensors_f64(
    path: impl AsRef<Path>,
    layout: &ParamLayout,
) -> Result<Vec<f64>, WeightsError> {
    load_flat_f64(path.as_ref(), layout)
}

/// Every tensor of a safetensors file by name: `(shape, values as f64)`.
///
/// Errors: [`WeightsError::Io`], [`WeightsError::Format`], [`WeightsError::UnsupportedDtype`].
#[allow(clippy::type_complexity)]
pub fn load_tensors_f64(
    path: impl AsRef<Path>,
) -> Result<BTreeMap<String, (Vec<usize>, Vec<f64>)>, WeightsError> {
    let path = path.as_ref();
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let values = tensor_f64(path, &name, &view)?;
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(out)
}

/// Names of the tensors stored in a safetensors file, sorted.
///
/// Errors: [`WeightsError::Io`], [`WeightsError::Format`].
pub fn tensor_names(path: impl AsRef<Path>) -> Result<Vec<String>, WeightsError> {
    let path = path.as_ref();
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    Ok(names)
}

/// Writes the flat f32 buffer as `model.safetensors` the way `save_pretrained` does: one F32
/// tensor per layout entry with its HF name and shape (the tied decoder tensors are not in the
/// layout, so they are not written), metadata `{"format": "pt"}`. Atomic: a temp file in the
/// same folder, fsync, rename.
///
/// Errors: [`WeightsError::LengthMismatch`] if `params.len() != layout.total_len()`,
/// [`WeightsError::Io`], [`WeightsError::Format`].
pub fn save_safetensors(
    path: impl AsRef<Path>,
    layout: &ParamLayout,
    params: &[f32],
) -> Result<(), WeightsError> {
    let path = path.as_ref();
    if params.len() != layout.total_len() {
        return Err(WeightsError::LengthMismatch {
            expected: layout.total_len(),
            got: params.len(),
        });
    }
    let bytes: Vec<Vec<u8>> = layout
        .entries()
        .iter()
        .map(|e| {
            params[e.range()]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        })
        .collect();
    let format_err = |e: safetensors::SafeTensorError| WeightsError::Format {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let mut views = Vec::with_capacity(layout.entries().len());
    for (entry, data) in layout.entries().iter().zip(&bytes) {
        let view = TensorView::new(Dtype::F32, entry.shape.clone(), data).map_err(format_err)?;
        views.push((entry.name.clone(), view));
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let serialized = safetensors::tensor::serialize(views, Some(metadata)).map_err(format_err)?;
    write_atomic(path, &serialized)
}

/// Writes `bytes` to `path` through a temp file in the same folder, fsync and rename.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), WeightsError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io_err(path))?;
    tmp.write_all(bytes).map_err(io_err(path))?;
    tmp.as_file().sync_all().map_err(io_err(path))?;
    tmp.persist(path).map_err(|e| WeightsError::Io {
        path: path.display().to_string(),
        source: e.error,
    })?;
    Ok(())
}
