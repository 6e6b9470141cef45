//! Each job's TensorBoard event file (`keel_proto::tensorboard`), beside its `metrics.jsonl`:
//! the driver gives every metrics line it appends to [`EventLogs::append`] too.
//!
//! Each coordinator process starts a new event file per job the first time it writes for
//! the job, and never appends to one written before it started (whose last record a crash
//! may have cut short); after a failed write it starts another. TensorBoard reads them all.

use keel_proto::metrics::MetricsLine;
use keel_proto::tensorboard::{self, EventFile};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

/// A step line's event is synced once every this many steps; eval lines and restarts always
/// are. Between syncs a machine crash (not a coordinator crash) may lose recent steps,
/// which `metrics.jsonl` still has.
const SYNC_EVERY_STEPS: u64 = 50;

/// The event file this process writes for each job folder.
#[derive(Debug)]
pub struct EventLogs {
    /// Job folder -> the event file this process created in it.
    files: Mutex<HashMap<PathBuf, EventFile>>,
    /// This machine's name, for new files' names (TensorBoard's convention).
    host: String,
}

impl EventLogs {
    /// No files yet; new ones are named after this machine.
    pub fn new() -> Self {
        EventLogs {
            files: Mutex::new(HashMap::new()),
            host: keel_proto::host::hostname(),
        }
    }

    /// Writes the events of `line` into the event file of the job folder `dir` (created on
    /// first use). A failure is logged, naming the file, and the next line starts a new file.
    pub fn append(&self, dir: &Path, line: &MetricsLine) {
        let now = SystemTime::now();
        let events = tensorboard::events_of(line, now);
        if events.is_empty() {
            return;
        }
        let sync = match line {
            MetricsLine::Step(s) => s.step % SYNC_EVERY_STEPS == 0,
            _ => true,
        };
        let mut files = self
            .files
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let file = match files.get(dir) {
            Some(file) => file.clone(),
            None => match EventFile::create(dir, now, &self.host) {
                Ok(file) => {
                    files.insert(dir.to_path_buf(), file.clone());
                    file
                }
                Err(e) => {
                    tracing::warn!("cannot start a TensorBoard event file: {e}");
                    return;
                }
            },
        };
        if let Err(e) = file.append(&events, sync) {
            tracing::warn!(
                "cannot append to the TensorBoard event file (a new one starts with the next line): {e}"
            );
            files.remove(dir);
        }
    }
}

impl Default for EventLogs {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_proto::metrics::EvalLine;

    #[test]
    fn one_file_per_folder_per_process_and_a_new_one_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let line = MetricsLine::Eval(EvalLine {
            eval_accuracy: 0.5,
            eval_loss: 6.0,
            eval_masked_tokens: 10,
            eval_perplexity: 403.4,
            step: 3,
        });
        let logs = EventLogs::new();
        logs.append(dir.path(), &line);
        logs.append(dir.path(), &line);
        let files = tensorboard::event_files(dir.path()).unwrap();
        assert_eq!(files.len(), 1);
        let bytes = std::fs::read(&files[0].1).unwrap();
        // The version event and two evaluations.
        assert_eq!(tensorboard::record::read_records(&bytes).unwrap().len(), 3);

        // A restarted coordinator: a new file; the first is left as it was.
        EventLogs::new().append(dir.path(), &line);
        let after = tensorboard::event_files(dir.path()).unwrap();
        assert_eq!(after.len(), 2);
        assert_eq!(std::fs::read(&files[0].1).unwrap(), bytes);

        // A folder that cannot take a file: logged, nothing panics.
        logs.append(&dir.path().join("missing"), &line);
    }
}
