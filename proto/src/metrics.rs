//! The lines of a job's `metrics.jsonl`: one JSON object per line, appended by the coordinator
//! and read by `keel pull` (the loss curve), `keel local` (throughput) and the tests.
//!
//! The file format is a contract: [`MetricsLine`] writes exactly the field names and value
//! types the coordinator wrote with `serde_json::json!` before this type existed (object keys
//! in sorted order, a non-finite number as `null`), and reads those files back. Kinds of lines:
//! - a step line ([`StepLine`]), one per training step, from rank 0's report;
//! - an eval line ([`EvalLine`]), one per held-out evaluation;
//! - an event line ([`EventLine`], with an `"event"` field): `resume`, `recovery`, `grow`,
//!   `stall`;
//! - any other object ([`MetricsLine::Other`]): a kind a newer coordinator writes, kept as it
//!   is, so that readers skip it instead of failing.
//!
//! ```
//! use keel_proto::metrics::{EvalLine, MetricsLine};
//! let line = MetricsLine::Eval(EvalLine {
//!     step: 10,
//!     eval_loss: 6.5,
//!     eval_accuracy: 0.125,
//!     eval_perplexity: 665.1,
//!     eval_masked_tokens: 512,
//! });
//! let text = line.to_json_line();
//! assert_eq!(MetricsLine::parse(&text).unwrap(), line);
//! ```

use serde::{Deserialize, Deserializer, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The file name of a job's metrics, in its job folder and beside a pulled checkpoint.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// Errors reading or appending a metrics file.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The file could not be read, opened or appended to.
    #[error("{path}: {source}")]
    Io {
        /// The metrics file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A line is not a JSON object of a known shape (a known kind with a field of the wrong
    /// type, say).
    #[error("{path}: metrics line {line}: {source}")]
    Line {
        /// The metrics file.
        path: PathBuf,
        /// The line's number, from 1.
        line: usize,
        /// What was wrong with it.
        source: serde_json::Error,
    },
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq)]
pub enum MetricsLine {
    /// A training step, as rank 0 reported it.
    Step(StepLine),
    /// A held-out evaluation.
    Eval(EvalLine),
    /// Something that happened to the job (an object with an `"event"` field).
    Event(EventLine),
    /// An object of a kind this version does not know (a newer coordinator's): kept verbatim.
    Other(serde_json::Map<String, serde_json::Value>),
}

/// A training step: `{"allreduce_seconds":..,"grad_norm":..,"loss":..,"lr":..,
/// "mlm_accuracy":..,"mlm_loss":..,"nsp_loss":..,"skipped":..,"step":..,"step_seconds":..,
/// "tokens":..,"tokens_per_s":..}`. Numbers that are not finite (the loss of a skipped
/// step) are written as `null` and read back as NaN; a field an older file lacks reads as NaN
/// (numbers), 0 or `false`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepLine {
    /// Seconds the step spent in gradient all-reduce.
    #[serde(default = "nan", deserialize_with = "number_or_nan")]
    pub allreduce_seconds: f64,
    /// Global gradient norm before clipping.
    #[serde(default = "nan", deserialize_with = "number_or_nan")]
    pub grad_norm: f64,
    /// Total training loss (MLM plus NSP when the job has NSP), in nats.
    #[serde(deserialize_with = "number_or_nan")]
    pub loss: f64,
    /// Learning rate used for the step.
    #[serde(default = "nan", deserialize_with = "number_or_nan")]
    pub lr: f64,
    /// Fraction of masked tokens predicted right (0 to 1).
    #[serde(default = "nan", deserialize_with = "number_or_nan")]
    pub mlm_accuracy: f64,
    /// Masked-LM loss, in nats.
    #[serde(default = "nan", deserialize_with = "number_or_nan")]
    pub mlm_loss: f64,
    /// Next-sentence loss, in nats (0 without NSP).
    #[serde(default = "nan", deserialize_with = "number_or_nan")]
    pub nsp_loss: f64,
    /// The step's training phase, from 1, in a job with `[[phase]]` sections
    /// (`crate::phases`); 0, and not written, in a job of one phase.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub phase: u32,
    /// Whether the update was skipped (non-finite loss or gradient).
    #[serde(default)]
    pub skipped: bool,
    /// The step number, from 1.
    pub step: u64,
    /// Wall-clock seconds of the step.
    #[serde(default = "nan", deserialize_with = "number_or_nan")]
    pub step_seconds: f64,
    /// Tokens the whole ring trained on in the step.
    #[serde(default)]
    pub tokens: u64,
    /// Training throughput of the whole ring, tokens per second.
    #[serde(default = "nan", deserialize_with = "number_or_nan")]
    pub tokens_per_s: f64,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A held-out evaluation: `{"eval_accuracy":..,"eval_loss":..,"eval_masked_tokens":..,
/// "eval_perplexity":..,"step":..}` (non-finite numbers as `null`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalLine {
    /// Fraction of held-out masked tokens predicted right (0 to 1).
    #[serde(default = "nan", deserialize_with = "number_or_nan")]
    pub eval_accuracy: f64,
    /// Held-out masked-LM loss, in nats.
    #[serde(deserialize_with = "number_or_nan")]
    pub eval_loss: f64,
    /// Masked tokens the evaluation scored.
    #[serde(default)]
    pub eval_masked_tokens: u64,
    /// `exp(eval_loss)`.
    #[serde(default = "nan", deserialize_with = "number_or_nan")]
    pub eval_perplexity: f64,
    /// The step after which it ran.
    pub step: u64,
}

/// An event line: `{"event":"<kind>", ...}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "lowercase")]
pub enum EventLine {
    /// A generation started from a saved state (checkpoint or held step), or a later
    /// generation started: lines after it continue from its `step` (after a resume from a
    /// checkpoint, steps after it appear again; the later lines are the ones that count).
    Resume(ResumeEvent),
    /// A worker was lost: the ring is being re-formed.
    Recovery(RegroupEvent),
    /// Workers joined: the ring is being re-formed larger.
    Grow(RegroupEvent),
    /// The job made no progress for its `progress_timeout_seconds`: the silent workers are
    /// dropped.
    Stall(StallEvent),
    /// A checkpoint upload could not be stored (a full disk, a broken stream).
    #[serde(rename = "checkpoint_failed")]
    CheckpointFailed(CheckpointFailedEvent),
}

/// `{"event":"checkpoint_failed","error":..,"free_bytes":..,"needed_bytes":..,"path":..,
/// "step":..,"waiting":..}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointFailedEvent {
    /// The checkpoint's step.
    pub step: u64,
    /// The folder it was to be stored in.
    pub path: String,
    /// Bytes it needs, when known (a full disk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub needed_bytes: Option<u64>,
    /// Bytes free in that folder's file system, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_bytes: Option<u64>,
    /// Why.
    pub error: String,
    /// It is the final checkpoint: the job waits, holding its state, until it is stored.
    #[serde(default)]
    pub waiting: bool,
}

/// `{"event":"resume","generation":..,"source":..,"step":..,"world_size":..}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResumeEvent {
    /// The membership generation that starts.
    pub generation: u64,
    /// Where the starting state comes from: the `StateSource` name (`STATE_SOURCE_CHECKPOINT`,
    /// ...).
    pub source: String,
    /// The step the generation starts after.
    pub step: u64,
    /// Ranks in the new ring.
    pub world_size: u64,
}

/// `{"event":"recovery"|"grow","generation":..,"reason":..,"step":..}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegroupEvent {
    /// The generation being formed (one more than the ring that was left).
    pub generation: u64,
    /// Why (the lost worker and its error, or the joining workers).
    pub reason: String,
    /// The job's step when it happened.
    pub step: u64,
}

/// `{"event":"stall","dropped":[..],"generation":..,"silent_seconds":..,"step":..,
/// "workers":[{"step":..,"worker":..}]}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StallEvent {
    /// Worker ids dropped from the ring.
    pub dropped: Vec<String>,
    /// The stalled generation.
    pub generation: u64,
    /// Seconds without progress.
    #[serde(deserialize_with = "number_or_nan")]
    pub silent_seconds: f64,
    /// The job's step when it stalled.
    pub step: u64,
    /// Every member and the step its heartbeats last named.
    pub workers: Vec<StallWorker>,
}

/// One member of a stalled ring: `{"step":..,"worker":..}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StallWorker {
    /// The step its heartbeats last named for the generation; `null` if they never named it.
    pub step: Option<u64>,
    /// `w-2 (127.0.0.1:7072)`.
    pub worker: String,
}

fn nan() -> f64 {
    f64::NAN
}

/// A number, or `null` (how serde_json writes a non-finite one) as NaN.
fn number_or_nan<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl MetricsLine {
    /// The line's JSON object, keys sorted (as `serde_json::json!` wrote them), non-finite
    /// numbers as `null`.
    pub fn to_value(&self) -> serde_json::Value {
        let value = match self {
            MetricsLine::Step(s) => serde_json::to_value(s),
            MetricsLine::Eval(e) => serde_json::to_value(e),
            MetricsLine::Event(e) => serde_json::to_value(e),
            MetricsLine::Other(map) => return serde_json::Value::Object(map.clone()),
        };
        // Plain structs of numbers, strings and lists: serializing them cannot fail.
        value.unwrap_or(serde_json::Value::Null)
    }

    /// The line as written to the file, without the newline.
    pub fn to_json_line(&self) -> String {
        self.to_value().to_string()
    }

    /// Reads one line. An object with an `"event"` field is an event (one of an unknown kind
    /// is [`MetricsLine::Other`]); else one with `eval_loss` is an eval line, one with `loss`
    /// a step line; any other object is [`MetricsLine::Other`].
    ///
    /// Errors: the text is not a JSON object, or a known kind has a field of the wrong type
    /// or lacks `step` (or `event` lines their fields).
    pub fn parse(line: &str) -> Result<MetricsLine, serde_json::Error> {
        let map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(line)?;
        MetricsLine::from_map(map)
    }

    fn from_map(
        map: serde_json::Map<String, serde_json::Value>,
    ) -> Result<MetricsLine, serde_json::Error> {
        let known_event = |e: &serde_json::Value| {
            matches!(
                e.as_str(),
                Some("resume" | "recovery" | "grow" | "stall" | "checkpoint_failed")
            )
        };
        let kind = match map.get("event") {
            Some(e) if known_event(e) => Kind::Event,
            Some(_) => return Ok(MetricsLine::Other(map)),
            None if map.contains_key("eval_loss") => Kind::Eval,
            None if map.contains_key("loss") => Kind::Step,
            None => return Ok(MetricsLine::Other(map)),
        };
        let value = serde_json::Value::Object(map);
        match kind {
            Kind::Event => serde_json::from_value(value).map(MetricsLine::Event),
            Kind::Eval => serde_json::from_value(value).map(MetricsLine::Eval),
            Kind::Step => serde_json::from_value(value).map(MetricsLine::Step),
        }
    }

    /// The step the line names, if it names one.
    pub fn step(&self) -> Option<u64> {
        match self {
            MetricsLine::Step(s) => Some(s.step),
            MetricsLine::Eval(e) => Some(e.step),
            MetricsLine::Event(EventLine::Resume(r)) => Some(r.step),
            MetricsLine::Event(EventLine::Recovery(r) | EventLine::Grow(r)) => Some(r.step),
            MetricsLine::Event(EventLine::Stall(s)) => Some(s.step),
            MetricsLine::Event(EventLine::CheckpointFailed(c)) => Some(c.step),
            MetricsLine::Other(map) => map.get("step").and_then(|s| s.as_u64()),
        }
    }
}

/// The known kinds of line, told apart by their keys.
enum Kind {
    Step,
    Eval,
    Event,
}

impl Serialize for MetricsLine {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(s)
    }
}

impl<'de> Deserialize<'de> for MetricsLine {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let map = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        MetricsLine::from_map(map).map_err(serde::de::Error::custom)
    }
}

impl From<StepLine> for MetricsLine {
    fn from(line: StepLine) -> Self {
        MetricsLine::Step(line)
    }
}

impl From<EvalLine> for MetricsLine {
    fn from(line: EvalLine) -> Self {
        MetricsLine::Eval(line)
    }
}

impl From<EventLine> for MetricsLine {
    fn from(line: EventLine) -> Self {
        MetricsLine::Event(line)
    }
}

/// Appends `line` and a newline to the metrics file at `path`, creating it if needed. One
/// `write` call per line, so concurrent appenders do not interleave within a line.
///
/// Errors: [`MetricsError::Io`].
pub fn append(path: &Path, line: &MetricsLine) -> Result<(), MetricsError> {
    let mut text = line.to_json_line();
    text.push('\n');
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|source| MetricsError::Io {
            path: path.to_path_buf(),
            source,
        })
}

/// Reads every line of the metrics text `text` (blank lines skipped); `path` only names the
/// file in errors.
///
/// Errors: [`MetricsError::Line`] naming the file and the first bad line (1-based).
pub fn parse_all(path: &Path, text: &str) -> Result<Vec<MetricsLine>, MetricsError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            MetricsLine::parse(l).map_err(|source| MetricsError::Line {
                path: path.to_path_buf(),
                line: i + 1,
                source,
            })
        })
        .collect()
}

/// Reads a whole metrics file.
///
/// Errors: [`MetricsError::Io`] when it cannot be read; [`MetricsError::Line`] naming the file
/// and the first bad line.
pub fn read(path: &Path) -> Result<Vec<MetricsLine>, MetricsError> {
    let text = std::fs::read_to_string(path).map_err(|source| MetricsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_all(path, &text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines exactly as the coordinator wrote them with `serde_json::json!` (service.rs,
    /// scheduler.rs, recovery.rs, watchdog.rs), including a skipped step's NaN loss.
    const TODAY: [&str; 9] = [
        r#"{"allreduce_seconds":0.012,"grad_norm":3.25,"loss":9.875,"lr":0.0001,"mlm_accuracy":0.0625,"mlm_loss":9.125,"nsp_loss":0.75,"skipped":false,"step":1,"step_seconds":0.5,"tokens":4096,"tokens_per_s":8192.0}"#,
        r#"{"allreduce_seconds":0.0,"grad_norm":null,"loss":null,"lr":0.0001,"mlm_accuracy":0.0,"mlm_loss":null,"nsp_loss":0.0,"skipped":true,"step":2,"step_seconds":0.25,"tokens":4096,"tokens_per_s":16384.0}"#,
        r#"{"eval_accuracy":0.125,"eval_loss":6.5,"eval_masked_tokens":512,"eval_perplexity":665.1416330443618,"step":10}"#,
        r#"{"event":"resume","generation":2,"source":"STATE_SOURCE_CHECKPOINT","step":10,"world_size":2}"#,
        r#"{"event":"recovery","generation":1,"reason":"worker w-2 lost: heartbeat timeout","step":12}"#,
        r#"{"event":"grow","generation":2,"reason":"2 workers joined","step":14}"#,
        r#"{"dropped":["w-2"],"event":"stall","generation":3,"silent_seconds":30.5,"step":20,"workers":[{"step":20,"worker":"w-1 (127.0.0.1:7071)"},{"step":null,"worker":"w-2 (127.0.0.1:7072)"}]}"#,
        r#"{"error":"no room","event":"checkpoint_failed","free_bytes":1048576,"needed_bytes":8388608,"path":"/data/jobs/job-1/checkpoints","step":20,"waiting":true}"#,
        r#"{"event":"done","step":20}"#,
    ];

    #[test]
    fn today_s_lines_read_and_write_back_byte_for_byte() {
        for text in TODAY {
            let line = MetricsLine::parse(text).unwrap();
            assert_eq!(line.to_json_line(), text);
        }
        let kinds: Vec<&str> = TODAY
            .iter()
            .map(|t| match MetricsLine::parse(t).unwrap() {
                MetricsLine::Step(_) => "step",
                MetricsLine::Eval(_) => "eval",
                MetricsLine::Event(EventLine::Resume(_)) => "resume",
                MetricsLine::Event(EventLine::Recovery(_)) => "recovery",
                MetricsLine::Event(EventLine::Grow(_)) => "grow",
                MetricsLine::Event(EventLine::Stall(_)) => "stall",
                MetricsLine::Event(EventLine::CheckpointFailed(_)) => "checkpoint_failed",
                MetricsLine::Other(_) => "other",
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "step",
                "step",
                "eval",
                "resume",
                "recovery",
                "grow",
                "stall",
                "checkpoint_failed",
                "other"
            ]
        );
    }

    #[test]
    fn constructed_lines_match_what_json_wrote() {
        let step = MetricsLine::Step(StepLine {
            allreduce_seconds: 0.0,
            grad_norm: f64::NAN,
            loss: f64::NAN,
            lr: 0.0001,
            mlm_accuracy: 0.0,
            mlm_loss: f64::INFINITY,
            nsp_loss: 0.0,
            phase: 0,
            skipped: true,
            step: 2,
            step_seconds: 0.25,
            tokens: 4096,
            tokens_per_s: 16384.0,
        });
        assert_eq!(step.to_json_line(), TODAY[1]);
        let resume = MetricsLine::Event(EventLine::Resume(ResumeEvent {
            generation: 2,
            source: "STATE_SOURCE_CHECKPOINT".into(),
            step: 10,
            world_size: 2,
        }));
        assert_eq!(resume.to_json_line(), TODAY[3]);
        let stall = MetricsLine::Event(EventLine::Stall(StallEvent {
            dropped: vec!["w-2".into()],
            generation: 3,
            silent_seconds: 30.5,
            step: 20,
            workers: vec![
                StallWorker {
                    step: Some(20),
                    worker: "w-1 (127.0.0.1:7071)".into(),
                },
                StallWorker {
                    step: None,
                    worker: "w-2 (127.0.0.1:7072)".into(),
                },
            ],
        }));
        assert_eq!(stall.to_json_line(), TODAY[6]);
        assert_eq!(
            MetricsLine::parse(&stall.to_json_line()).unwrap(),
            stall,
            "round trip"
        );
    }

    #[test]
    fn lines_of_older_files_read_with_defaults() {
        let MetricsLine::Step(s) =
            MetricsLine::parse(r#"{"step":1,"loss":9.5,"lr":1e-4}"#).unwrap()
        else {
            panic!("not a step line")
        };
        assert_eq!((s.step, s.loss, s.lr, s.tokens), (1, 9.5, 1e-4, 0));
        assert!(s.tokens_per_s.is_nan());
        assert!(matches!(
            MetricsLine::parse(r#"{"step":1}"#).unwrap(),
            MetricsLine::Other(_)
        ));
    }

    #[test]
    fn a_file_appends_and_reads_back_and_names_a_bad_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(METRICS_FILE);
        let lines: Vec<MetricsLine> = TODAY
            .iter()
            .map(|t| MetricsLine::parse(t).unwrap())
            .collect();
        for line in &lines {
            append(&path, line).unwrap();
        }
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, TODAY.join("\n") + "\n");
        let back = read(&path).unwrap();
        assert_eq!(back.len(), lines.len());
        assert_eq!(back[0], lines[0]);
        std::fs::write(&path, format!("{}\n\nnot json\n", TODAY[0])).unwrap();
        let err = read(&path).unwrap_err().to_string();
        assert!(err.contains("metrics line 3"), "{err}");
        assert!(err.contains(METRICS_FILE), "{err}");
        std::fs::write(&path, r#"{"step":"one","loss":1.0}"#).unwrap();
        let err = read(&path).unwrap_err().to_string();
        assert!(err.contains("metrics line 1"), "{err}");
        let missing = read(&dir.path().join("none.jsonl")).unwrap_err();
        assert!(matches!(missing, MetricsError::Io { .. }));
    }
}
