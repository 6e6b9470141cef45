//! The TensorBoard messages Keel writes, as prost structs: only the fields it sets, with the
//! field numbers of TensorFlow's protos (a reader skips what it does not know, and fields
//! left out here are simply never written):
//! - `Event`, `SessionLog`: `tensorflow/core/util/event.proto` (also vendored as
//!   `tensorboard/compat/proto/event.proto`);
//! - `Summary`, `Summary.Value`: `tensorflow/core/framework/summary.proto`
//!   (`tensorboard/compat/proto/summary.proto`).

/// The `file_version` the first event of every file carries; TensorBoard reads version 2
/// files with restarts marked by [`SessionStatus::Start`] events.
pub const FILE_VERSION: &str = "brain.Event:2";

/// One event: a wall time, a step and what happened (`tensorflow.Event`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch when it was written.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The training step it belongs to.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// What the event holds.
    #[prost(oneof = "What", tags = "3, 5, 7")]
    pub what: Option<What>,
}

/// The `what` oneof of `tensorflow.Event` (the variants Keel writes).
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    /// The file's format, in its first event: [`FILE_VERSION`].
    #[prost(string, tag = "3")]
    FileVersion(String),
    /// Scalar values.
    #[prost(message, tag = "5")]
    Summary(Summary),
    /// A session started or stopped.
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

/// `tensorflow.Summary`: a list of tagged values.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    /// The values.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with only its `simple_value` (a scalar).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    /// The curve's name (`train/loss`).
    #[prost(string, tag = "1")]
    pub tag: String,
    /// The value (TensorBoard stores scalars as 32-bit floats). A member of the `value`
    /// oneof in summary.proto, so it is written even when 0 (a plain proto3 float would be
    /// left out, and TensorBoard would see no scalar at all); `optional` encodes the same.
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// `tensorflow.SessionLog`: a run (re)started; with `status: START` at step `s`, TensorBoard
/// drops the values it holds at steps `s` and later (they are about to be written again).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionLog {
    /// What happened.
    #[prost(enumeration = "SessionStatus", tag = "1")]
    pub status: i32,
}

/// `tensorflow.SessionLog.SessionStatus`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum SessionStatus {
    /// Not set.
    StatusUnspecified = 0,
    /// A run (re)started.
    Start = 1,
    /// A run stopped.
    Stop = 2,
    /// A checkpoint was written.
    Checkpoint = 3,
}

impl Event {
    /// The first event of a file: its version.
    pub fn file_version(wall_time: f64) -> Self {
        Event {
            wall_time,
            step: 0,
            what: Some(What::FileVersion(FILE_VERSION.to_string())),
        }
    }

    /// Scalars `(tag, value)` at `step`.
    pub fn scalars<'a>(
        wall_time: f64,
        step: u64,
        values: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> Self {
        Event {
            wall_time,
            step: step_i64(step),
            what: Some(What::Summary(Summary {
                value: values
                    .into_iter()
                    .map(|(tag, v)| SummaryValue {
                        tag: tag.to_string(),
                        simple_value: Some(v as f32),
                    })
                    .collect(),
            })),
        }
    }

    /// A restart whose first new values are at `step`.
    pub fn restart(wall_time: f64, step: u64) -> Self {
        Event {
            wall_time,
            step: step_i64(step),
            what: Some(What::SessionLog(SessionLog {
                status: SessionStatus::Start as i32,
            })),
        }
    }
}

/// A step as TensorBoard's signed 64-bit step (steps past `i64::MAX` saturate; none do).
fn step_i64(step: u64) -> i64 {
    i64::try_from(step).unwrap_or(i64::MAX)
}
