//! The dashboard's JSON API (`/api/...`), read from the machine and the jobs' files. It needs
//! the cluster token unless the port is on loopback (`keel_net::http_port`).
//!
//! - `GET /api/jobs`: `{"jobs": [job...]}` in submission order; a job is its `keel status`
//!   fields with the state as a lower-case name (`running`) and non-finite numbers as `null`.
//! - `GET /api/jobs/{job}/metrics?from=OFFSET`: `{"lines": [...], "next": OFFSET}`: the job's
//!   `metrics.jsonl` lines (each the object as written) after `from`, at most
//!   [`MAX_LINES`] of them and only whole lines; ask again with `next`. `from` is a byte
//!   offset, opaque to clients: start at 0.
//! - `GET /api/workers`: `{"workers": [worker...]}` in registration order: id, address,
//!   state (`training`, `idle`, `lost`), job, rank, step, generation, seconds since its last
//!   heartbeat, its last step's time and ring wait.
//!
//! Errors: `404` with `{"error": ...}` for an unknown job, `500` when its metrics file cannot
//! be read.

use super::metrics::state_name;
use crate::driver::Shared;
use crate::machine::WorkerEntry;
use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use keel_net::http_port::json_error;
use keel_proto::protocol::HEARTBEAT_TIMEOUT;
use keel_proto::rpc::JobStatus;
use serde_json::{Value, json};
use std::io::{BufRead, Read, Seek, SeekFrom};
use std::sync::Arc;
use std::time::Instant;

/// Most metrics lines one call returns.
pub const MAX_LINES: usize = 5000;
/// Most bytes of metrics one call reads (a step line is ~300 bytes).
const MAX_BYTES: u64 = 4 << 20;

/// A finite number, or `null`.
fn number(x: f64) -> Value {
    if x.is_finite() { json!(x) } else { Value::Null }
}

/// A job's status as the API shows it.
pub fn job_json(s: &JobStatus) -> Value {
    json!({
        "job_id": s.job_id,
        "state": state_name(s.state()),
        "generation": s.generation,
        "step": s.step,
        "max_steps": s.max_steps,
        "loss": number(s.loss),
        "learning_rate": number(s.learning_rate),
        "tokens_per_second": number(s.tokens_per_second),
        "step_seconds": number(s.step_seconds),
        "eval_loss": number(s.eval_loss),
        "eval_accuracy": number(s.eval_accuracy),
        "elapsed_seconds": number(s.elapsed_seconds),
        "recoveries": s.recoveries,
        "skipped_steps": s.skipped_steps,
        "precision": s.precision,
        "workers": s.workers,
        "checkpoints": s.checkpoints,
        "error": s.error,
        "checkpoint_failures": s.checkpoint_failures,
        "checkpoint_problem": s.checkpoint_problem,
    })
}

/// A registered worker as the API shows it, at `now`.
pub fn worker_json(w: &WorkerEntry, now: Instant) -> Value {
    let silent = now.saturating_duration_since(w.last_seen());
    let state = if !w.reachable() || silent >= HEARTBEAT_TIMEOUT {
        "lost"
    } else if w.job().is_some() {
        "training"
    } else {
        "idle"
    };
    let (step, generation) = w.progress();
    let times = w.step_times();
    json!({
        "id": w.id(),
        "address": w.advertise_addr(),
        "state": state,
        "job": w.job().map(|(j, _)| j),
        "rank": w.job().map(|(_, r)| r),
        "step": step,
        "generation": generation,
        "last_heartbeat_seconds_ago": silent.as_secs_f64(),
        "step_seconds": times.map(|t| t.step_seconds),
        "ring_wait_seconds": times.map(|t| t.ring_wait_seconds),
    })
}

/// `GET /api/jobs`.
pub async fn jobs(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let now = Instant::now();
    let jobs: Vec<Value> = shared.read(|m| m.jobs().map(|j| job_json(&j.status(now))).collect());
    Json(json!({ "jobs": jobs }))
}

/// `GET /api/workers`.
pub async fn workers(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let now = Instant::now();
    let workers: Vec<Value> = shared.read(|m| m.workers().map(|w| worker_json(w, now)).collect());
    Json(json!({ "workers": workers }))
}

/// The query of `GET /api/jobs/{job}/metrics`.
#[derive(Debug, serde::Deserialize)]
pub struct From {
    /// Byte offset to read from (what the last call returned as `next`); 0 by default.
    #[serde(default)]
    from: u64,
}

/// `GET /api/jobs/{job}/metrics?from=OFFSET`.
pub async fn job_metrics(
    State(shared): State<Arc<Shared>>,
    Path(job_id): Path<String>,
    Query(query): Query<From>,
) -> Response {
    let path = match shared.read(|m| m.job(&job_id).map(|j| j.dir().join("metrics.jsonl"))) {
        Ok(path) => path,
        Err(e) => return json_error(StatusCode::NOT_FOUND, e.to_string()),
    };
    let read = tokio::task::spawn_blocking(move || read_lines(&path, query.from)).await;
    match read {
        Ok(Ok((lines, next))) => Json(json!({ "lines": lines, "next": next })).into_response(),
        Ok(Err(e)) => json_error(StatusCode::INTERNAL_SERVER_ERROR, e),
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// The whole JSON lines of `path` after byte `from` (at most [`MAX_LINES`] and
/// `MAX_BYTES`), and the offset after the last one returned. A missing file has no lines;
/// a line that is not JSON is skipped (a reader must not stop at one bad line); an offset
/// past the end (the file was replaced) starts again at 0.
///
/// Errors: the file cannot be read, as a message naming it.
pub fn read_lines(path: &std::path::Path, from: u64) -> Result<(Vec<Value>, u64), String> {
    let fail = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(fail(e)),
    };
    let len = file.metadata().map_err(fail)?.len();
    let from = if from > len { 0 } else { from };
    file.seek(SeekFrom::Start(from)).map_err(fail)?;
    let mut reader = std::io::BufReader::new(file.take(MAX_BYTES));
    let (mut lines, mut next, mut buf) = (Vec::new(), from, Vec::new());
    while lines.len() < MAX_LINES {
        buf.clear();
        let n = reader.read_until(b'\n', &mut buf).map_err(fail)?;
        if n == 0 || buf.last() != Some(&b'\n') {
            break; // the end, or a line still being written
        }
        next += n as u64;
        if let Ok(value) = serde_json::from_slice::<Value>(&buf) {
            lines.push(value);
        }
    }
    Ok((lines, next))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_lines_are_read_whole_and_resumed_from_next() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("metrics.jsonl");
        assert_eq!(read_lines(&path, 0).expect("missing"), (Vec::new(), 0));
        std::fs::write(&path, "{\"step\":1}\nnot json\n{\"step\":2}\n{\"step\":3").expect("write");
        let (lines, next) = read_lines(&path, 0).expect("read");
        assert_eq!(lines, vec![json!({"step": 1}), json!({"step": 2})]);
        assert_eq!(next, 31, "the unfinished last line is left for later");
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("open");
        std::io::Write::write_all(&mut file, b"}\n").expect("append");
        assert_eq!(
            read_lines(&path, next).expect("again").0,
            vec![json!({"step": 3})]
        );
        assert_eq!(read_lines(&path, 10_000).expect("past the end").0.len(), 3);
    }

    #[test]
    fn unknown_numbers_are_null() {
        let status = JobStatus {
            job_id: "job-1".into(),
            loss: f64::NAN,
            step: 3,
            ..Default::default()
        };
        let v = job_json(&status);
        assert_eq!(v["loss"], Value::Null);
        assert_eq!(v["step"], json!(3));
        assert_eq!(v["state"], json!("unspecified"));
    }
}
