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
//! - [`check_finite`] / [`check_finite_bytes`] / [`check_finite_params`]: no NaN or Inf in a
//!   file (weights or optimizer state) or a flat buffer, else the first tensor that has one.

use std::collections::{BTreeMap, HashMap};
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
    #[error(
        "{path}: tensor `{name}` is missing{}",
        crate::params::missing_hint(name)
    )]
    MissingTensor {
        /// The file.
        path: String,
        /// HF name of the tensor.
        name: String,
    },
    /// A tensor has the wrong shape: the model config does not describe these weights. The
    /// message names the config fields that give the expected shape.
    #[error(
        "{path}: tensor `{name}` has shape {got:?}, but the model config gives {expected:?} \
         ({}): the config does not describe these weights",
        crate::params::config_fields(name)
    )]
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
    /// A tensor holds NaN or infinite values.
    #[error("{path}: {name} has {count} non-finite values (first at element {first}: {value})")]
    NonFinite {
        /// The file (or what the buffer is, for a flat buffer).
        path: String,
        /// HF name of the tensor.
        name: String,
        /// How many elements are NaN or infinite.
        count: usize,
        /// Index of the first one within the tensor (row-major).
        first: usize,
        /// Its value (`NaN`, `inf` or `-inf`).
        value: f64,
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

/// `values` as little-endian bytes, the layout of an F32 tensor (bytemuck's cast on a
/// little-endian machine).
pub fn f32_to_le_bytes(values: &[f32]) -> Vec<u8> {
    #[cfg(target_endian = "little")]
    let bytes = bytemuck::cast_slice::<f32, u8>(values).to_vec();
    #[cfg(not(target_endian = "little"))]
    let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes
}

/// The f32 values of little-endian bytes at any alignment (an F32 tensor's data); a trailing
/// part of an element is ignored.
pub fn f32_from_le_bytes(bytes: &[u8]) -> Vec<f32> {
    let whole = &bytes[..bytes.len() / 4 * 4];
    #[cfg(target_endian = "little")]
    let values = bytemuck::pod_collect_to_vec::<u8, f32>(whole);
    #[cfg(not(target_endian = "little"))]
    let values = whole
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    values
}

/// Reads a tensor's elements as f64 (F32 widened exactly).
fn tensor_f64(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Vec<f64>, WeightsError> {
    let data = view.data();
    match view.dtype() {
        Dtype::F32 => Ok(f32_from_le_bytes(data).into_iter().map(f64::from).collect()),
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

/// Largest safetensors header read (bytes: 100 MiB, the `safetensors` crate's own cap).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Reads a safetensors file whole, after checking its header against its size: the header
/// (8-byte little-endian length `n`, then `n` bytes of JSON) must fit in the file, and the
/// tensors' `data_offsets` must end exactly at the file's end. So a file grown past its
/// tensors (a 2 GB sparse tail) or cut short is refused after reading `8 + n` bytes, not the
/// whole file. Only a regular file is read.
///
/// Errors: [`WeightsError::Io`]; [`WeightsError::Format`] naming the file and the sizes.
fn read_file(path: &Path) -> Result<Vec<u8>, WeightsError> {
    use std::io::Read;
    let format = |reason: String| WeightsError::Format {
        path: path.display().to_string(),
        reason,
    };
    let (mut file, size) = crate::limits::open_regular(path).map_err(|e| match e {
        crate::limits::LimitError::Io { source, .. } => io_err(path)(source),
        other => format(other.to_string()),
    })?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| format(format!("{size} bytes is too short for a header")))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER_BYTES || n > size.saturating_sub(8) {
        return Err(format(format!(
            "the header claims {n} bytes but the file has {size} (and headers are at most \
             {MAX_HEADER_BYTES})"
        )));
    }
    let mut raw = vec![0u8; n as usize];
    file.read_exact(&mut raw).map_err(io_err(path))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&raw).map_err(|e| format(format!("header: {e}")))?;
    let mut data_end = 0u64;
    for (name, entry) in &header {
        if name == "__metadata__" {
            continue;
        }
        let end = entry
            .get("data_offsets")
            .and_then(|o| o.get(1))
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| format(format!("header: tensor `{name}` has no data_offsets")))?;
        data_end = data_end.max(end);
    }
    let expected = 8 + n + data_end;
    if expected != size {
        return Err(format(format!(
            "the header describes {expected} bytes but the file has {size}: it was truncated \
             or grown"
        )));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    bytes.extend_from_slice(&len);
    bytes.extend_from_slice(&raw);
    // Bounded by the size just checked: a file that grows meanwhile is cut, then refused by
    // the parser for its missing or extra bytes.
    file.take(data_end)
        .read_to_end(&mut bytes)
        .map_err(io_err(path))?;
    Ok(bytes)
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>, WeightsError> {
    SafeTensors::deserialize(bytes).map_err(|e| WeightsError::Format {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// Loads the layout's tensors as f64 into a flat buffer of `layout.total_len()` elements.
///
/// Every tensor's presence and shape is checked against the file's header before the buffer
/// is allocated: a config that does not describe the file (one at the size caps beside a
/// small model) is refused naming the tensor and the config fields, instead of asking for
/// terabytes. Once every shape matches, the buffer holds no more values than the file does.
fn load_flat_f64(path: &Path, layout: &ParamLayout) -> Result<Vec<f64>, WeightsError> {
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let mut views = Vec::with_capacity(layout.entries().len());
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
        views.push((entry, view));
    }
    let mut flat = vec![0.0f64; layout.total_len()];
    for (entry, view) in views {
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

/// Counts the non-finite values of `values`: `(count, first index, first value)`, `None` when all
/// are finite.
fn non_finite(values: impl Iterator<Item = f64>) -> Option<(usize, usize, f64)> {
    let mut found: Option<(usize, usize, f64)> = None;
    for (i, v) in values.enumerate() {
        if !v.is_finite() {
            match &mut found {
                Some((count, ..)) => *count += 1,
                None => found = Some((1, i, v)),
            }
        }
    }
    found
}

/// An IEEE half's value as far as finiteness goes: NaN or ±inf when its exponent bits are all
/// set, else 0 (its finite value does not matter here).
fn f16_special(bits: u16) -> f64 {
    if bits & 0x7c00 != 0x7c00 {
        0.0
    } else if bits & 0x03ff != 0 {
        f64::NAN
    } else if bits & 0x8000 != 0 {
        f64::NEG_INFINITY
    } else {
        f64::INFINITY
    }
}

/// Checks that every floating-point tensor (F16, BF16, F32, F64) of a safetensors file holds
/// only finite values: a checkpoint never contains NaN or Inf. Integer tensors (e.g.
/// `bert.embeddings.position_ids`) are skipped. Tensors are checked in name order.
///
/// Errors: [`WeightsError::NonFinite`] naming the first tensor (by name) with a NaN or Inf and
/// how many it has; [`WeightsError::Io`], [`WeightsError::Format`].
pub fn check_finite(path: impl AsRef<Path>) -> Result<(), WeightsError> {
    let path = path.as_ref();
    let bytes = read_file(path)?;
    check_finite_bytes(&bytes, &path.display().to_string())
}

/// As [`check_finite`], on the bytes of a safetensors file; `origin` names it in errors.
///
/// Errors: [`WeightsError::NonFinite`], [`WeightsError::Format`].
pub fn check_finite_bytes(bytes: &[u8], origin: &str) -> Result<(), WeightsError> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| WeightsError::Format {
        path: origin.to_string(),
        reason: e.to_string(),
    })?;
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, view) in tensors {
        let data = view.data();
        let found = match view.dtype() {
            Dtype::F32 => non_finite(
                data.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64),
            ),
            Dtype::F64 => non_finite(
                data.chunks_exact(8)
                    .map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])),
            ),
            // Half precision: the value is non-finite exactly when its exponent bits are all set.
            Dtype::F16 => non_finite(
                data.chunks_exact(2)
                    .map(|b| f16_special(u16::from_le_bytes([b[0], b[1]]))),
            ),
            Dtype::BF16 => non_finite(data.chunks_exact(2).map(|b| {
                let bits = u16::from_le_bytes([b[0], b[1]]);
                f32::from_bits(u32::from(bits) << 16) as f64
            })),
            _ => None,
        };
        if let Some((count, first, value)) = found {
            return Err(WeightsError::NonFinite {
                path: origin.to_string(),
                name,
                count,
                first,
                value,
            });
        }
    }
    Ok(())
}

/// Checks a flat parameter (or optimizer moment) buffer laid out as `layout` for NaN and Inf
/// before it is saved or uploaded; `what` names the buffer in errors ("parameters after step 7").
///
/// Errors: [`WeightsError::NonFinite`] naming the first tensor of the layout with a non-finite
/// value; [`WeightsError::LengthMismatch`] if `params.len() != layout.total_len()`.
pub fn check_finite_params(
    layout: &ParamLayout,
    params: &[f32],
    what: &str,
) -> Result<(), WeightsError> {
    if params.len() != layout.total_len() {
        return Err(WeightsError::LengthMismatch {
            expected: layout.total_len(),
            got: params.len(),
        });
    }
    for entry in layout.entries() {
        if let Some((count, first, value)) =
            non_finite(params[entry.range()].iter().map(|&v| f64::from(v)))
        {
            return Err(WeightsError::NonFinite {
                path: what.to_string(),
                name: entry.name.clone(),
                count,
                first,
                value,
            });
        }
    }
    Ok(())
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
        .map(|e| f32_to_le_bytes(&params[e.range()]))
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

/// Writes `bytes` to `path` with [`crate::atomic::write_atomic`] (mode 0600).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), WeightsError> {
    crate::atomic::write_atomic(path, bytes, crate::atomic::Access::Owner).map_err(|e| {
        WeightsError::Io {
            path: e.path.display().to_string(),
            source: e.source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BertConfig;
    use crate::params::Heads;

    fn file_with(tensors: &[(&str, Vec<f32>)]) -> Vec<u8> {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((name, v), b)| {
                let view = TensorView::new(Dtype::F32, vec![v.len()], b).unwrap();
                (name.to_string(), view)
            })
            .collect();
        safetensors::tensor::serialize(views, None).unwrap()
    }

    #[test]
    fn check_finite_names_the_tensor_and_counts_its_bad_values() {
        let good = file_with(&[("a.weight", vec![1.0, -2.0]), ("b.bias", vec![0.5])]);
        check_finite_bytes(&good, "good.safetensors").unwrap();
        let bad = file_with(&[
            ("a.weight", vec![1.0, 2.0]),
            (
                "bert.encoder.layer.1.output.dense.weight",
                vec![0.0, f32::NAN, 1.0, f32::INFINITY, f32::NEG_INFINITY],
            ),
        ]);
        let err = check_finite_bytes(&bad, "model.safetensors").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("bert.encoder.layer.1.output.dense.weight has 3 non-finite values"),
            "{text}"
        );
        assert!(text.starts_with("model.safetensors"), "{text}");
        assert!(
            matches!(err, WeightsError::NonFinite { first: 1, .. }),
            "{err}"
        );
    }

    #[test]
    fn check_finite_reads_files_and_refuses_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optimizer.safetensors");
        std::fs::write(&path, file_with(&[("m", vec![f32::NAN])])).unwrap();
        let err = check_finite(&path).unwrap_err();
        assert!(err.to_string().contains("optimizer.safetensors"), "{err}");
        std::fs::write(&path, b"not a safetensors file").unwrap();
        assert!(matches!(
            check_finite(&path),
            Err(WeightsError::Format { .. })
        ));
    }

    #[test]
    fn f16_specials_are_recognised() {
        assert!(f16_special(0x7c00).is_infinite() && f16_special(0x7c00) > 0.0);
        assert!(f16_special(0xfc00).is_infinite() && f16_special(0xfc00) < 0.0);
        assert!(f16_special(0x7e00).is_nan());
        assert!(f16_special(0x3c00).is_finite());
    }

    #[test]
    fn check_finite_params_names_the_layout_tensor() {
        let config = BertConfig::preset("tiny", 64).unwrap();
        let layout = ParamLayout::bert(&config, Heads::MaskedLm);
        let mut params = vec![0.25f32; layout.total_len()];
        check_finite_params(&layout, &params, "parameters").unwrap();
        let entry = &layout.entries()[3];
        params[entry.range().start + 2] = f32::NAN;
        let err = check_finite_params(&layout, &params, "parameters after step 7").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&format!("{} has 1 non-finite values", entry.name)),
            "{text}"
        );
        assert!(text.starts_with("parameters after step 7"), "{text}");
        assert!(check_finite_params(&layout, &params[1..], "p").is_err());
    }
}
