//! `keel.v1.Coordinator`: translates RPCs to the machine's inputs (`crate::machine`) and its
//! errors to `Status`. Nothing here decides what happens to a job.

use crate::CoordinatorError;
use crate::driver::Shared;
use crate::files::send_files;
use crate::machine::{Input, Registration, Reply, SaveError, StepTimes};
use crate::store;
use keel_proto::jobspec::JobSpec;
use keel_proto::protocol::{HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT};
use keel_proto::rpc::coordinator_server::Coordinator;
use keel_proto::rpc::*;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
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

/// How long a submission waits for its job's first record to be written (the driver tries
/// again every tick) before it is refused.
const SUBMIT_RECORD_WAIT: Duration = Duration::from_secs(5);

impl CoordinatorService {
    /// A service over the coordinator's shared state.
    pub fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// Waits until the just-submitted job `id`'s record is on disk, so that an accepted job
    /// survives a coordinator restart. If it cannot be written within
    /// [`SUBMIT_RECORD_WAIT`], the job is withdrawn, its folder `dir` removed, and the
    /// submission refused.
    ///
    /// Errors: as [`Self::withdraw`].
    async fn recorded_or_withdrawn(&self, id: &str, dir: &Path) -> Result<(), Status> {
        let started = Instant::now();
        loop {
            self.shared.flushed().await;
            let (recorded, error) = self.shared.read(|m| {
                m.job(id).map_or((false, None), |j| {
                    (j.is_recorded(), j.save_error().cloned())
                })
            });
            if recorded {
                return Ok(());
            }
            if started.elapsed() >= SUBMIT_RECORD_WAIT {
                let why = error.unwrap_or_else(|| SaveError {
                    message: "it was not written in time".to_string(),
                    storage_full: false,
                });
                return self.withdraw(id, dir, why).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Refuses the submission of `id` (its record could not be written: `why`): forgets the
    /// job and removes its folder, after any write of it still queued.
    ///
    /// Errors: `ResourceExhausted` when the file system is full, `Internal` otherwise; both
    /// name the record's file and why.
    async fn withdraw(&self, id: &str, dir: &Path, why: SaveError) -> Result<(), Status> {
        if let Err(e) = self.shared.apply(Input::Withdraw {
            job_id: id.to_string(),
        }) {
            // Written after all (between the check and now): accepted.
            tracing::info!(job = id, "not withdrawn: {e}");
            return Ok(());
        }
        self.shared.flushed().await;
        let folder = dir.to_path_buf();
        let removed = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&folder))
            .await
            .map_err(std::io::Error::other)
            .and_then(|r| r);
        if let Err(e) = removed {
            tracing::error!(job = id, dir = %dir.display(), "cannot remove a withdrawn job's folder: {e}");
        }
        let message = format!(
            "job not accepted: its record could not be written ({}); the coordinator's data \
             folder must be writable with room to spare: fix it and submit again",
            why.message
        );
        Err(if why.storage_full {
            Status::resource_exhausted(message)
        } else {
            Status::internal(message)
        })
    }
}

/// The reply a machine input was expected to give.
fn unexpected(reply: Reply) -> Status {
    Status::internal(format!(
        "unexpected reply from the coordinator's state: {reply:?}"
    ))
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
        let Reply::Reserved { id, dir } =
            self.shared.apply(Input::Reserve { spec: spec.clone() })?
        else {
            return Err(Status::internal("no job number reserved"));
        };
        // The job's folder and files are made outside the state's lock; the job is queued once
        // they are there.
        let toml = req.spec_toml.clone();
        let dir2 = dir.clone();
        tokio::task::spawn_blocking(move || -> Result<(), CoordinatorError> {
            std::fs::create_dir_all(&dir2).map_err(CoordinatorError::io(&dir2))?;
            keel_proto::checkpoint::write_file_atomic(&dir2.join("job.toml"), toml.as_bytes())?;
            std::fs::File::create(dir2.join("metrics.jsonl"))
                .map_err(CoordinatorError::io(&dir2))?;
            Ok(())
        })
        .await
        .map_err(|e| Status::internal(format!("making the job's folder: {e}")))??;
        tracing::info!(job = %id, origin, "job submitted");
        self.shared.apply(Input::Submitted {
            id: id.clone(),
            spec,
            dir: dir.clone(),
            wall: SystemTime::now(),
        })?;
        self.recorded_or_withdrawn(&id, &dir).await?;
        Ok(Response::new(SubmitJobReply { job_id: id }))
    }

    async fn list_jobs(
        &self,
        _: Request<ListJobsRequest>,
    ) -> Result<Response<ListJobsReply>, Status> {
        self.shared.flushed().await;
        let now = Instant::now();
        let jobs = self
            .shared
            .read(|m| m.jobs().map(|j| j.status(now)).collect());
        Ok(Response::new(ListJobsReply { jobs }))
    }

    async fn get_job(
        &self,
        request: Request<GetJobRequest>,
    ) -> Result<Response<JobStatus>, Status> {
        let id = request.into_inner().job_id;
        self.shared.flushed().await;
        let status = self
            .shared
            .read(|m| m.job(&id).map(|j| j.status(Instant::now())))?;
        Ok(Response::new(status))
    }

    async fn cancel_job(
        &self,
        request: Request<CancelJobRequest>,
    ) -> Result<Response<JobStatus>, Status> {
        let job_id = request.into_inner().job_id;
        let reply = self.shared.apply(Input::Cancel { job_id })?;
        // The cancellation is on disk before the user is told.
        self.shared.flushed().await;
        match reply {
            Reply::Status(status) => Ok(Response::new(*status)),
            other => Err(unexpected(other)),
        }
    }

    type WatchJobStream = RpcStream<JobStatus>;

    async fn watch_job(
        &self,
        request: Request<GetJobRequest>,
    ) -> Result<Response<Self::WatchJobStream>, Status> {
        let id = request.into_inner().job_id;
        self.shared.flushed().await;
        let mut rx = self.shared.subscribe(&id)?;
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
        self.shared.flushed().await;
        let (dir, step) = self.shared.read(|m| -> Result<_, Status> {
            let job = m.job(&req.job_id)?;
            let checkpoints = job.checkpoints();
            let step = if req.step == 0 {
                checkpoints.last().copied().ok_or_else(|| {
                    CoordinatorError::NotFound(format!("job {} has no checkpoint yet", req.job_id))
                })?
            } else if checkpoints.contains(&req.step) {
                req.step
            } else {
                // Say which steps can be pulled instead of only "not found".
                let have = if checkpoints.is_empty() {
                    "it has no checkpoint yet".to_string()
                } else {
                    let steps: Vec<String> = checkpoints.iter().map(|s| s.to_string()).collect();
                    format!("its checkpoints are at steps {}", steps.join(", "))
                };
                return Err(CoordinatorError::NotFound(format!(
                    "job {} has no checkpoint at step {}; {have}",
                    req.job_id, req.step
                ))
                .into());
            };
            Ok((job.dir().to_path_buf(), step))
        })?;
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
        let id = request.into_inner().job_id;
        self.shared.flushed().await;
        let dir = self
            .shared
            .read(|m| m.job(&id).map(|j| j.dir().to_path_buf()))?;
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(send_files(
            vec![("metrics.jsonl".to_string(), dir.join("metrics.jsonl"))],
            tx,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type PullTensorboardStream = RpcStream<FileChunk>;

    async fn pull_tensorboard(
        &self,
        request: Request<GetJobRequest>,
    ) -> Result<Response<Self::PullTensorboardStream>, Status> {
        let id = request.into_inner().job_id;
        self.shared.flushed().await;
        let dir = self
            .shared
            .read(|m| m.job(&id).map(|j| j.dir().to_path_buf()))?;
        let files = keel_proto::tensorboard::event_files(&dir)
            .map_err(|e| Status::internal(e.to_string()))?;
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(send_files(files, tx));
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
        let registration = Registration {
            advertise_addr: req.advertise_addr,
            threads: req.threads,
            bf16_native: req.bf16_native,
            bf16_detail: req.bf16_detail,
            hostname: req.hostname,
            holds: req.held,
            memory_limit: req.memory_limit_bytes,
        };
        let id = match self.shared.apply(Input::Register(registration))? {
            Reply::Registered { worker_id } => worker_id,
            other => return Err(unexpected(other)),
        };
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
        let known = matches!(
            self.shared.apply(Input::Heartbeat {
                worker_id: req.worker_id,
                key: req.key,
                times: StepTimes::from_heartbeat(
                    req.last_step_seconds,
                    req.last_ring_wait_seconds,
                ),
            })?,
            Reply::Known(true)
        );
        Ok(Response::new(HeartbeatReply { known }))
    }

    type AttachStream = RpcStream<WorkerCommand>;

    async fn attach(
        &self,
        request: Request<AttachRequest>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let id = request.into_inner().worker_id;
        let (attach, rx) = self.shared.attach(&id)?;
        // The stream closes when the worker process dies or its connection breaks: the machine
        // treats it as dead at once rather than after the heartbeat timeout.
        tokio::spawn(self.shared.clone().watch_attach(id, attach));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type FetchFileStream = RpcStream<FileChunk>;

    async fn fetch_file(
        &self,
        request: Request<FetchFileRequest>,
    ) -> Result<Response<Self::FetchFileStream>, Status> {
        let req = request.into_inner();
        let path = self.shared.read(|m| -> Result<_, CoordinatorError> {
            let job = m.current(req.key.as_ref())?;
            job.file(&req.name).cloned().ok_or_else(|| {
                CoordinatorError::NotFound(format!("job {} has no file {}", job.id(), req.name))
            })
        })?;
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(send_files(vec![(req.name, path)], tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn report_step(&self, request: Request<StepReport>) -> Result<Response<Ack>, Status> {
        self.shared.apply(Input::Step(request.into_inner()))?;
        Ok(Response::new(Ack {}))
    }

    async fn report_eval(&self, request: Request<EvalReport>) -> Result<Response<Ack>, Status> {
        self.shared.apply(Input::Eval(request.into_inner()))?;
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
        self.shared.apply(Input::Done(request.into_inner()))?;
        Ok(Response::new(Ack {}))
    }

    async fn report_failure(
        &self,
        request: Request<FailureReport>,
    ) -> Result<Response<Ack>, Status> {
        self.shared.apply(Input::Failure(request.into_inner()))?;
        Ok(Response::new(Ack {}))
    }

    async fn report_held(&self, request: Request<HeldReport>) -> Result<Response<Ack>, Status> {
        self.shared.apply(Input::Held(request.into_inner()))?;
        Ok(Response::new(Ack {}))
    }
}
