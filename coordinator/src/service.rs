//! `keel.v1.Coordinator`: translates RPCs to the registry and errors to `Status`.

use crate::CoordinatorError;
use crate::files::send_files;
use crate::job::Job;
use crate::state::{Shared, WorkerEntry};
use crate::store;
use keel_proto::jobspec::JobSpec;
use keel_proto::protocol::{HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT};
use keel_proto::rpc::coordinator_server::Coordinator;
use keel_proto::rpc::*;
use std::io::Write;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Bytes of a submitted job's origin (its file name) kept for messages and logs.
const MAX_ORIGIN_BYTES: usize = 256;

/// A server stream of `T`.
type RpcStream<T> = Pin<Box<dyn futures::Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The gRPC face of the coordinator.
#[derive(Debug, Clone)]
pub struct CoordinatorService {
    /// Registry and settings.
    shared: Arc<Shared>,
}

impl CoordinatorService {
    /// A service over the coordinator's shared state.
    pub fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }
}

/// Appends one JSON line to the job's `metrics.jsonl`.
pub(crate) fn append_metrics(job: &Job, value: serde_json::Value) {
    let path = job.dir.join("metrics.jsonl");
    let result = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| writeln!(f, "{value}"));
    if let Err(e) = result {
        tracing::warn!(path = %path.display(), "cannot append metrics: {e}");
    }
}

/// Refuses a step report that cannot be right: a rank outside the ring, a step outside
/// `1..=max_steps`, or (from rank 0, whose reports drive the metrics) a step at or before the
/// one already reported.
///
/// Errors: `BadRequest` (InvalidArgument) for the rank or range, `Stale` (FailedPrecondition)
/// for a report out of order.
fn check_step_report(job: &Job, step: u64, rank: u32) -> Result<(), CoordinatorError> {
    if rank as usize >= job.workers.len() {
        return Err(CoordinatorError::BadRequest(format!(
            "step report: rank {rank} is not in job {} ({} ranks)",
            job.id,
            job.workers.len()
        )));
    }
    if step == 0 || step > job.spec.train.max_steps {
        return Err(CoordinatorError::BadRequest(format!(
            "step report: step {step} is outside 1..={} of job {}",
            job.spec.train.max_steps, job.id
        )));
    }
    if rank == 0 && step <= job.step {
        return Err(CoordinatorError::Stale {
            job_id: job.id.clone(),
            message: format!(
                "step report for step {step} arrives after step {}: reports must come in order",
                job.step
            ),
        });
    }
    Ok(())
}

/// `18.2k` for 18200.
fn human(n: f64) -> String {
    if n >= 1e6 {
        format!("{:.1}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1}k", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    async fn ping(&self, _: Request<PingRequest>) -> Result<Response<PingReply>, Status> {
        Ok(Response::new(PingReply {
            version: env!("CARGO_PKG_VERSION").to_string(),
        }))
    }

    async fn submit_job(
        &self,
        request: Request<SubmitJobRequest>,
    ) -> Result<Response<SubmitJobReply>, Status> {
        let req = request.into_inner();
        // The origin is only a name for messages and logs: a bounded one.
        let origin = if req.origin.is_empty() {
            "job".to_string()
        } else {
            keel_proto::quote::bounded(&req.origin, MAX_ORIGIN_BYTES)
        };
        let origin = origin.as_str();
        let spec =
            JobSpec::from_toml_str(&req.spec_toml, origin).map_err(CoordinatorError::from)?;
        // Refuse now what preparation would fail on later (a corpus path that is not there):
        // the user is at the terminal now. Walking folders touches the disk: off the runtime.
        let (spec, checked) = {
            let origin = origin.to_string();
            let roots = self.shared.input_roots.clone();
            tokio::task::spawn_blocking(move || {
                let checked = crate::submit_check::check_job(&spec, &origin, &roots);
                (spec, checked)
            })
            .await
            .map_err(|e| Status::internal(format!("checking the job's paths: {e}")))?
        };
        checked.map_err(CoordinatorError::from)?;
        let mut reg = self.shared.lock();
        crate::admission::check_submission(&spec, &reg)?;
        reg.next_job += 1;
        let id = format!("job-{}", reg.next_job);
        let dir = self.shared.data_dir.join("jobs").join(&id);
        std::fs::create_dir_all(&dir).map_err(CoordinatorError::io(&dir))?;
        keel_proto::checkpoint::write_file_atomic(&dir.join("job.toml"), req.spec_toml.as_bytes())
            .map_err(CoordinatorError::from)?;
        std::fs::File::create(dir.join("metrics.jsonl")).map_err(CoordinatorError::io(&dir))?;
        tracing::info!(job = %id, origin, "job submitted");
        reg.jobs.insert(id.clone(), Job::new(id.clone(), spec, dir));
        reg.order.push(id.clone());
        drop(reg);
        self.shared.wake.notify_one();
        Ok(Response::new(SubmitJobReply { job_id: id }))
    }

    async fn list_jobs(
        &self,
        _: Request<ListJobsRequest>,
    ) -> Result<Response<ListJobsReply>, Status> {
        let reg = self.shared.lock();
        let jobs = reg
            .order
            .iter()
            .filter_map(|id| reg.jobs.get(id))
            .map(Job::status)
            .collect();
        Ok(Response::new(ListJobsReply { jobs }))
    }

    async fn get_job(
        &self,
        request: Request<GetJobRequest>,
    ) -> Result<Response<JobStatus>, Status> {
        let mut reg = self.shared.lock();
        let job = reg.job_mut(&request.into_inner().job_id)?;
        Ok(Response::new(job.status()))
    }

    async fn cancel_job(
        &self,
        request: Request<CancelJobRequest>,
    ) -> Result<Response<JobStatus>, Status> {
        let id = request.into_inner().job_id;
        let mut reg = self.shared.lock();
        reg.job_mut(&id)?;
        reg.end_job(
            &id,
            JobState::Cancelled,
            Some("cancelled by the user".into()),
        );
        let status = reg.job_mut(&id)?.status();
        Ok(Response::new(status))
    }

    type WatchJobStream = RpcStream<JobStatus>;

    async fn watch_job(
        &self,
        request: Request<GetJobRequest>,
    ) -> Result<Response<Self::WatchJobStream>, Status> {
        let id = request.into_inner().job_id;
        let mut rx = {
            let mut reg = self.shared.lock();
            reg.job_mut(&id)?.watch.subscribe()
        };
        let (tx, out) = mpsc::channel(16);
        tokio::spawn(async move {
            loop {
                let status = rx.borrow_and_update().clone();
                let finished = matches!(
                    JobState::try_from(status.state),
                    Ok(JobState::Completed | JobState::Failed | JobState::Cancelled)
                );
                if tx.send(Ok(status)).await.is_err() || finished {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }

    type PullCheckpointStream = RpcStream<FileChunk>;

    async fn pull_checkpoint(
        &self,
        request: Request<PullCheckpointRequest>,
    ) -> Result<Response<Self::PullCheckpointStream>, Status> {
        let req = request.into_inner();
        let (dir, step) = {
            let mut reg = self.shared.lock();
            let job = reg.job_mut(&req.job_id)?;
            let step = if req.step == 0 {
                job.checkpoints.last().copied().ok_or_else(|| {
                    CoordinatorError::NotFound(format!("job {} has no checkpoint yet", req.job_id))
                })?
            } else if job.checkpoints.contains(&req.step) {
                req.step
            } else {
                // Say which steps can be pulled instead of only "not found".
                let have = if job.checkpoints.is_empty() {
                    "it has no checkpoint yet".to_string()
                } else {
                    let steps: Vec<String> =
                        job.checkpoints.iter().map(|s| s.to_string()).collect();
                    format!("its checkpoints are at steps {}", steps.join(", "))
                };
                return Err(CoordinatorError::NotFound(format!(
                    "job {} has no checkpoint at step {}; {have}",
                    req.job_id, req.step
                ))
                .into());
            };
            (job.dir.clone(), step)
        };
        let files = store::checkpoint_files(&dir, step)?;
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(send_files(files, tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type PullMetricsStream = RpcStream<FileChunk>;

    async fn pull_metrics(
        &self,
        request: Request<GetJobRequest>,
    ) -> Result<Response<Self::PullMetricsStream>, Status> {
        let dir = {
            let mut reg = self.shared.lock();
            reg.job_mut(&request.into_inner().job_id)?.dir.clone()
        };
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(send_files(
            vec![("metrics.jsonl".to_string(), dir.join("metrics.jsonl"))],
            tx,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterReply>, Status> {
        let req = request.into_inner();
        if req.advertise_addr.is_empty() {
            return Err(Status::invalid_argument(
                "advertise_addr is empty: start the worker with --advertise-addr HOST:PORT",
            ));
        }
        let mut reg = self.shared.lock();
        reg.claim_address(&req.advertise_addr)?;
        reg.next_worker += 1;
        let number = reg.next_worker;
        let id = format!("w-{number}");
        let entry = WorkerEntry {
            id: id.clone(),
            number,
            advertise_addr: req.advertise_addr,
            threads: req.threads,
            bf16_native: req.bf16_native,
            bf16_detail: req.bf16_detail,
            hostname: req.hostname,
            last_seen: Instant::now(),
            job: None,
            step: 0,
            generation: 0,
            commands: None,
            disconnected: false,
            holds: req.held.filter(|k| !k.job_id.is_empty()),
            memory_limit: req.memory_limit_bytes,
        };
        // Fields without a value (no host name sent, nothing held) are left out of the line
        // rather than logged as `host= holds=`: a `None` field is not recorded.
        let host = (!entry.hostname.is_empty()).then(|| tracing::field::debug(&entry.hostname));
        let holds = entry.holds.as_ref().map(|k| {
            tracing::field::display(format!(
                "{} generation {} step {}",
                k.job_id, k.generation, k.step
            ))
        });
        tracing::info!(worker = %entry.describe(), threads = entry.threads, bf16_native = entry.bf16_native, bf16 = ?entry.bf16_detail, host, holds, "worker registered");
        reg.workers.insert(id.clone(), entry);
        Ok(Response::new(RegisterReply {
            worker_id: id,
            heartbeat_interval_ms: HEARTBEAT_INTERVAL.as_millis() as u64,
            heartbeat_timeout_ms: HEARTBEAT_TIMEOUT.as_millis() as u64,
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatReply>, Status> {
        let req = request.into_inner();
        let mut reg = self.shared.lock();
        let Some(w) = reg.workers.get_mut(&req.worker_id) else {
            return Ok(Response::new(HeartbeatReply { known: false }));
        };
        w.last_seen = Instant::now();
        if let Some(key) = req.key
            && w.job.as_ref().is_some_and(|(j, _)| *j == key.job_id)
        {
            w.step = key.step;
            w.generation = key.generation;
            // A member's step counts as the job's progress (its step reports may be queued
            // behind a checkpoint upload).
            if let Some(job) = reg.jobs.get_mut(&key.job_id)
                && job.generation == key.generation
                && job.state == JobState::Running
            {
                job.progress.note_step(key.step);
            }
        }
        Ok(Response::new(HeartbeatReply { known: true }))
    }

    type AttachStream = RpcStream<WorkerCommand>;

    async fn attach(
        &self,
        request: Request<AttachRequest>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let id = request.into_inner().worker_id;
        let (tx, rx) = mpsc::channel(16);
        {
            let mut reg = self.shared.lock();
            let w = reg
                .workers
                .get_mut(&id)
                .ok_or(CoordinatorError::UnknownWorker {
                    worker_id: id.clone(),
                })?;
            w.commands = Some(tx.clone());
            w.last_seen = Instant::now();
        }
        // The stream closes when the worker process dies or its connection breaks: treat it
        // as dead at once rather than after the heartbeat timeout.
        let shared = self.shared.clone();
        tokio::spawn(async move {
            tx.closed().await;
            let mut reg = shared.lock();
            if let Some(w) = reg.workers.get_mut(&id)
                && w.commands.as_ref().is_some_and(|c| c.same_channel(&tx))
            {
                tracing::warn!(worker = %w.describe(), "command stream closed");
                w.disconnected = true;
            }
            drop(reg);
            shared.wake.notify_one();
        });
        self.shared.wake.notify_one();
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type FetchFileStream = RpcStream<FileChunk>;

    async fn fetch_file(
        &self,
        request: Request<FetchFileRequest>,
    ) -> Result<Response<Self::FetchFileStream>, Status> {
        let req = request.into_inner();
        let path = {
            let mut reg = self.shared.lock();
            let job = reg.check_key(req.key.as_ref())?;
            job.files.get(&req.name).cloned().ok_or_else(|| {
                CoordinatorError::NotFound(format!("job {} has no file {}", job.id, req.name))
            })?
        };
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(send_files(vec![(req.name, path)], tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn report_step(&self, request: Request<StepReport>) -> Result<Response<Ack>, Status> {
        let r = request.into_inner();
        let mut reg = self.shared.lock();
        let job = reg.check_key(r.key.as_ref())?;
        let step = r.key.as_ref().map_or(0, |k| k.step);
        check_step_report(job, step, r.rank)?;
        if r.rank == 0 && step > job.step {
            job.step = step;
            job.progress.note_step(step);
            append_metrics(
                job,
                serde_json::json!({
                    "step": step,
                    "loss": r.loss,
                    "mlm_loss": r.mlm_loss,
                    "nsp_loss": r.nsp_loss,
                    "mlm_accuracy": r.mlm_accuracy,
                    "lr": r.learning_rate,
                    "grad_norm": r.grad_norm,
                    "tokens_per_s": r.tokens_per_second,
                    "step_seconds": r.step_seconds,
                    "allreduce_seconds": r.allreduce_seconds,
                    "tokens": r.tokens,
                    "skipped": r.skipped,
                }),
            );
            tracing::info!(
                job = %job.id,
                "step {step} | loss {:.4} | lr {:.1e} | {:.0} ms | {} tok/s | allreduce {:.0} ms",
                r.loss,
                r.learning_rate,
                r.step_seconds * 1e3,
                human(r.tokens_per_second),
                r.allreduce_seconds * 1e3
            );
            job.skipped_steps = job.skipped_steps.max(r.skipped_steps);
            if r.skipped {
                tracing::warn!(job = %job.id, step, "non-finite loss or gradient: the update was skipped ({} so far)", r.skipped_steps);
            }
            job.last_step = Some(r);
            job.publish();
        }
        Ok(Response::new(Ack {}))
    }

    async fn report_eval(&self, request: Request<EvalReport>) -> Result<Response<Ack>, Status> {
        let r = request.into_inner();
        let mut reg = self.shared.lock();
        let job = reg.check_key(r.key.as_ref())?;
        let step = r.key.as_ref().map_or(0, |k| k.step);
        append_metrics(
            job,
            serde_json::json!({
                "step": step,
                "eval_loss": r.mlm_loss,
                "eval_accuracy": r.mlm_accuracy,
                "eval_perplexity": r.perplexity,
                "eval_masked_tokens": r.masked_tokens,
            }),
        );
        tracing::info!(
            job = %job.id,
            "eval at step {step} | mlm loss {:.4} | accuracy {:.3} | perplexity {:.2}",
            r.mlm_loss,
            r.mlm_accuracy,
            r.perplexity
        );
        job.progress.touch();
        job.last_eval = Some(r);
        job.publish();
        Ok(Response::new(Ack {}))
    }

    async fn upload_checkpoint(
        &self,
        request: Request<Streaming<FileChunk>>,
    ) -> Result<Response<Ack>, Status> {
        store::receive_upload(self.shared.clone(), request.into_inner()).await?;
        Ok(Response::new(Ack {}))
    }

    async fn report_done(&self, request: Request<DoneReport>) -> Result<Response<Ack>, Status> {
        let r = request.into_inner();
        let mut reg = self.shared.lock();
        let job = reg.check_key(r.key.as_ref())?;
        job.done.insert(r.rank);
        let all_done = job.done.len() == job.workers.len();
        let has_final = job.checkpoints.contains(&job.spec.train.max_steps);
        let id = job.id.clone();
        if all_done {
            if has_final {
                job.step = job.spec.train.max_steps;
                reg.end_job(&id, keel_proto::rpc::JobState::Completed, None);
            } else {
                reg.end_job(
                    &id,
                    JobState::Failed,
                    Some("all ranks finished but no final checkpoint was stored".into()),
                );
            }
        }
        Ok(Response::new(Ack {}))
    }

    async fn report_failure(
        &self,
        request: Request<FailureReport>,
    ) -> Result<Response<Ack>, Status> {
        let r = request.into_inner();
        let mut reg = self.shared.lock();
        let id = reg.check_key(r.key.as_ref())?.id.clone();
        let step = r.key.as_ref().map_or(0, |k| k.step);
        let ranks = reg
            .jobs
            .get(&id)
            .map(|j| reg.describe_ranks(j))
            .unwrap_or_default();
        let who = reg
            .workers
            .get(&r.worker_id)
            .map_or(r.worker_id.clone(), |w| w.describe());
        let message = format!(
            "rank {} {who} failed at step {step}: {} [ring: {ranks}]",
            r.rank, r.error
        );
        if r.recoverable {
            crate::recovery::begin(&mut reg, &id, message, &[], true);
            // The failed worker said what it holds: that is its answer to the Suspend just
            // sent (which it may also answer; the later answer wins, both say the same).
            crate::recovery::held_with_failure(&mut reg, &id, &r.worker_id, &r.held_steps);
        } else {
            reg.end_job(&id, JobState::Failed, Some(message));
        }
        drop(reg);
        self.shared.wake.notify_one();
        Ok(Response::new(Ack {}))
    }

    async fn report_held(&self, request: Request<HeldReport>) -> Result<Response<Ack>, Status> {
        let mut reg = self.shared.lock();
        crate::recovery::held_reported(&mut reg, request.into_inner())?;
        drop(reg);
        self.shared.wake.notify_one();
        Ok(Response::new(Ack {}))
    }
}
