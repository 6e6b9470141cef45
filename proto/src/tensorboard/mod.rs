//! A job's scalars as TensorBoard event files (`events.out.tfevents.<unix seconds>.<host>`),
//! which `tensorboard --logdir` reads beside `metrics.jsonl`.
//!
//! No maintained Rust crate writes them (`tensorboard-rs` is unmaintained), and the format is
//! small: framed records ([`record`]) each holding a serialized `tensorflow.Event`
//! ([`event`]). A file starts with a `file_version` event; every metrics line then becomes
//! one event ([`events_of`]):
//!
//! | metrics line | tag | unit |
//! |---|---|---|
//! | step `loss`, `mlm_loss`, `nsp_loss` | `train/loss`, `train/mlm_loss`, `train/nsp_loss` | nats |
//! | step `mlm_accuracy` | `train/mlm_accuracy` | fraction, 0 to 1 |
//! | step `lr` | `train/learning_rate` | |
//! | step `grad_norm` | `train/grad_norm` | L2 norm before clipping |
//! | step `tokens_per_s` | `train/tokens_per_second` | tokens/s, whole ring |
//! | step `step_seconds`, `allreduce_seconds` | `train/step_seconds`, `train/allreduce_seconds` | seconds |
//! | eval `eval_loss`, `eval_accuracy`, `eval_perplexity` | `eval/loss`, `eval/accuracy`, `eval/perplexity` | nats, fraction, |
//! | `resume` event at step `s` | a `SessionLog` START at step `s + 1` | |
//!
//! The restart event makes TensorBoard drop the values it holds from step `s + 1` on, as
//! readers of `metrics.jsonl` let later lines win after a resume. Values are 32-bit floats;
//! a non-finite one (the loss of a skipped step) is written as it is.
//!
//! A writer never appends to a file it did not create ([`EventFile::create`] refuses an
//! existing name), so a coordinator that restarts after a write was cut short starts a new
//! file rather than writing after a torn record; TensorBoard reads every event file of the
//! folder in name order.

pub mod event;
pub mod record;

use crate::metrics::{EventLine, MetricsLine};
use event::Event;
use prost::Message;
use std::io::Write;
use std::path::{Path, PathBuf};

/// What every TensorBoard event file's name starts with (TensorBoard takes any file whose
/// name contains `tfevents`).
pub const EVENT_FILE_PREFIX: &str = "events.out.tfevents.";

/// Errors writing an event file.
#[derive(Debug, thiserror::Error)]
pub enum TensorboardError {
    /// The file or its folder could not be created, written or synced.
    #[error("{path}: {source}")]
    Io {
        /// The event file (or its folder).
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// An event file this process created, appended to by reopening it (no descriptor is held
/// between appends).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventFile {
    /// The file.
    path: PathBuf,
}

impl EventFile {
    /// Creates a new event file in `dir` named `events.out.tfevents.<unix seconds>.<host>`
    /// (with `.1`, `.2`, ... after it when that name is taken: a restart within the same
    /// second), writes its `file_version` event, and syncs the file and the folder.
    ///
    /// Errors: [`TensorboardError::Io`] when the file cannot be created or written.
    pub fn create(
        dir: &Path,
        now: std::time::SystemTime,
        host: &str,
    ) -> Result<Self, TensorboardError> {
        let secs = now
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let base = format!("{EVENT_FILE_PREFIX}{secs}.{}", plain_host(host));
        let mut n = 0u32;
        let (path, mut file) = loop {
            let name = if n == 0 {
                base.clone()
            } else {
                format!("{base}.{n}")
            };
            let path = dir.join(name);
            match std::fs::OpenOptions::new()
                .append(true)
                .create_new(true)
                .open(&path)
            {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(source) => return Err(TensorboardError::Io { path, source }),
            }
        };
        let io = |source| TensorboardError::Io {
            path: path.clone(),
            source,
        };
        let mut bytes = Vec::new();
        record::frame_record(
            &Event::file_version(wall_time(now)).encode_to_vec(),
            &mut bytes,
        );
        file.write_all(&bytes).map_err(io)?;
        file.sync_all().map_err(io)?;
        // The new name is durable too.
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| TensorboardError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
        Ok(EventFile { path })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `events`, framed, in one write; syncs the file's data when `sync`.
    ///
    /// Errors: [`TensorboardError::Io`]; the file may then end in a partial record, so the
    /// caller should start a new file ([`EventFile::create`]) instead of appending again.
    pub fn append(&self, events: &[Event], sync: bool) -> Result<(), TensorboardError> {
        if events.is_empty() {
            return Ok(());
        }
        let mut bytes = Vec::new();
        for event in events {
            record::frame_record(&event.encode_to_vec(), &mut bytes);
        }
        let io = |source| TensorboardError::Io {
            path: self.path.clone(),
            source,
        };
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(io)?;
        file.write_all(&bytes).map_err(io)?;
        if sync {
            file.sync_data().map_err(io)?;
        }
        Ok(())
    }
}

/// The events for one metrics line written at `now` (none for a line TensorBoard has no
/// use for: recoveries, growth, stalls, unknown kinds).
pub fn events_of(line: &MetricsLine, now: std::time::SystemTime) -> Vec<Event> {
    let t = wall_time(now);
    match line {
        MetricsLine::Step(s) => vec![Event::scalars(
            t,
            s.step,
            [
                ("train/loss", s.loss),
                ("train/mlm_loss", s.mlm_loss),
                ("train/nsp_loss", s.nsp_loss),
                ("train/mlm_accuracy", s.mlm_accuracy),
                ("train/learning_rate", s.lr),
                ("train/grad_norm", s.grad_norm),
                ("train/tokens_per_second", s.tokens_per_s),
                ("train/step_seconds", s.step_seconds),
                ("train/allreduce_seconds", s.allreduce_seconds),
            ],
        )],
        MetricsLine::Eval(e) => vec![Event::scalars(
            t,
            e.step,
            [
                ("eval/loss", e.eval_loss),
                ("eval/accuracy", e.eval_accuracy),
                ("eval/perplexity", e.eval_perplexity),
            ],
        )],
        MetricsLine::Event(EventLine::Resume(r)) => {
            vec![Event::restart(t, r.step.saturating_add(1))]
        }
        MetricsLine::Event(_) | MetricsLine::Other(_) => Vec::new(),
    }
}

/// Whether `name` is a TensorBoard event file's name.
pub fn is_event_file_name(name: &str) -> bool {
    name.starts_with(EVENT_FILE_PREFIX)
}

/// The event files in `dir`, as `(name, path)`, in name order (TensorBoard's reading order);
/// none when `dir` does not exist.
///
/// Errors: [`TensorboardError::Io`] when `dir` exists but cannot be listed.
pub fn event_files(dir: &Path) -> Result<Vec<(String, PathBuf)>, TensorboardError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(TensorboardError::Io {
                path: dir.to_path_buf(),
                source,
            });
        }
    };
    let mut files: Vec<(String, PathBuf)> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            is_event_file_name(&name).then(|| (name, e.path()))
        })
        .collect();
    files.sort();
    Ok(files)
}

/// Seconds since the Unix epoch, as an event's `wall_time`.
fn wall_time(now: std::time::SystemTime) -> f64 {
    now.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// `host` with every character outside `[A-Za-z0-9._-]` replaced by `_` (a plain file-name
/// part), `localhost` when empty.
fn plain_host(host: &str) -> String {
    let host: String = host
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if host.is_empty() || host.chars().all(|c| c == '.') {
        "localhost".to_string()
    } else {
        host
    }
}

#[cfg(test)]
mod tests;
