//! A job's status as people and scripts read it: the state names (`running`,
//! `waiting-for-workers`, ...) and the JSON of `keel status --json`.
//!
//! The generated [`JobStatus`] derives `serde::Serialize` (see `build.rs`): every field under
//! its proto name, `state` as its name ([`state_name`]), `precision` as `null` while empty,
//! and numbers that are not finite (NaN before the first step) as `null`, as serde_json writes
//! them. [`status_json`] gives that object with its keys sorted.

use crate::rpc::{JobState, JobStatus};

/// The name of a [`JobState`] value (`queued`, `preparing`, `waiting-for-workers`, `running`,
/// `completed`, `failed`, `cancelled`, `recovering`); `unknown` for 0 or a value this version
/// does not know.
pub fn state_name(state: i32) -> &'static str {
    match JobState::try_from(state) {
        Ok(JobState::Queued) => "queued",
        Ok(JobState::Preparing) => "preparing",
        Ok(JobState::WaitingForWorkers) => "waiting-for-workers",
        Ok(JobState::Running) => "running",
        Ok(JobState::Completed) => "completed",
        Ok(JobState::Failed) => "failed",
        Ok(JobState::Cancelled) => "cancelled",
        Ok(JobState::Recovering) => "recovering",
        Ok(JobState::Unspecified) | Err(_) => "unknown",
    }
}

/// Serializes a `JobState` field (an `i32` in the generated code) as its [`state_name`].
///
/// Errors: the serializer's.
pub fn serialize_state<S: serde::Serializer>(state: &i32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(state_name(*state))
}

/// Whether a count is 0 (the `phase` fields of a job of one phase stay out of its JSON).
pub fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Whether a count is 0 (serde's `skip_serializing_if` for a count not shown until it is not).
pub fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

/// Serializes an empty string as `null` (a value not decided yet), any other as itself.
///
/// Errors: the serializer's.
pub fn empty_as_null<S: serde::Serializer>(text: &str, s: S) -> Result<S::Ok, S::Error> {
    if text.is_empty() {
        s.serialize_none()
    } else {
        s.serialize_str(text)
    }
}

/// `status` as the JSON object `keel status --json` prints (keys sorted; see the module
/// documentation).
pub fn status_json(status: &JobStatus) -> serde_json::Value {
    // A struct of numbers, strings and lists: serializing it cannot fail.
    serde_json::to_value(status).unwrap_or(serde_json::Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_json_keeps_today_s_fields_and_values() {
        let status = JobStatus {
            job_id: "job-1".into(),
            state: JobState::WaitingForWorkers as i32,
            generation: 2,
            step: 10,
            max_steps: 200,
            loss: 6.5,
            learning_rate: f64::NAN,
            tokens_per_second: 1000.0,
            step_seconds: 0.25,
            workers: vec!["w-1".into(), "w-2".into()],
            checkpoints: vec![5, 10],
            error: String::new(),
            eval_loss: f64::NAN,
            eval_accuracy: f64::INFINITY,
            elapsed_seconds: 12.5,
            recoveries: 1,
            skipped_steps: 0,
            precision: String::new(),
            phase: 0,
            phases: 0,
            checkpoint_failures: 0,
            checkpoint_problem: String::new(),
        };
        // What the cli's hand-written `json!` printed for it.
        let today = r#"{"checkpoints":[5,10],"elapsed_seconds":12.5,"error":"","eval_accuracy":null,"eval_loss":null,"generation":2,"job_id":"job-1","learning_rate":null,"loss":6.5,"max_steps":200,"precision":null,"recoveries":1,"skipped_steps":0,"state":"waiting-for-workers","step":10,"step_seconds":0.25,"tokens_per_second":1000.0,"workers":["w-1","w-2"]}"#;
        assert_eq!(status_json(&status).to_string(), today);
        let bf16 = JobStatus {
            precision: "bf16".into(),
            state: 99,
            ..status
        };
        let v = status_json(&bf16);
        assert_eq!(v["precision"], "bf16");
        assert_eq!(v["state"], "unknown");
        // A job with `[[phase]]` sections shows its phase; one of one phase does not (above).
        let phased = JobStatus {
            phase: 2,
            phases: 2,
            ..bf16
        };
        let v = status_json(&phased);
        assert_eq!(
            (v["phase"].as_u64(), v["phases"].as_u64()),
            (Some(2), Some(2))
        );
    }

    #[test]
    fn state_names_agree_with_the_derived_enum_names() {
        for state in 0..=8 {
            let Ok(s) = JobState::try_from(state) else {
                panic!("{state}")
            };
            assert_eq!(serde_json::to_value(s).unwrap(), state_name(state));
        }
    }
}
