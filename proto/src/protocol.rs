//! The control-plane protocol between the client, the coordinator and the workers
//! (`proto/keel.proto`, package `keel.v1`), written down once as numbered steps.
//!
//! Gradients never touch the coordinator: workers sum them among themselves with the ring
//! all-reduce (`proto/ring.proto`), which is also what keeps them in step. The coordinator
//! plans, watches liveness and stores checkpoints; it never gates a step.
//!
//! Every message about training carries a [`TrainingKey`](crate::rpc::TrainingKey):
//! `(job_id, generation, step)`. The generation names one membership of the job's ring.
//!
//! On the coordinator every step below that changes a job is one input of its state machine
//! (`keel_coordinator::machine`: registered, heartbeat, submitted, prepared, files built, step,
//! eval, done, failure, held, checkpoint stored, cancel, tick), whose phases are queued,
//! preparing, waiting for workers, running, recovering (gathering, collecting, forming,
//! verifying checkpoints) and finished; what the steps send and save are its effects.
//!
//! # Steps
//! 1. **Register.** A worker calls `Register{advertise_addr, threads, hostname}` and gets a
//!    `worker_id`, the heartbeat interval and the heartbeat timeout. The advertise address is
//!    given explicitly by the worker's operator (`--advertise-addr`); nothing guesses it.
//!    A worker that still holds a job's state in memory (the coordinator restarted, say) says
//!    so: `held = (job, generation, latest step)`.
//! 2. **Heartbeat.** Every interval (1 s) the worker calls `Heartbeat{worker_id, key}` with the
//!    `(job, generation, step)` it is at (empty job when idle). A worker silent for the
//!    heartbeat timeout, or whose `Attach` stream closed, is lost: its job recovers without
//!    it (step 14) or, with `max_recoveries = 0`, fails naming it and its last step. The
//!    timeout is the job's `[cluster] peer_timeout_seconds` while the worker is in a job, else
//!    [`HEARTBEAT_TIMEOUT`].
//!    `known = false` in the reply means the coordinator restarted: register again.
//! 3. **Submit.** The client sends the job spec as TOML, its relative paths already made
//!    absolute (they are read on the coordinator's machine; a relative one is refused). The
//!    coordinator validates it, checks its paths against its `--input-root` folders, and
//!    returns a job id; the job is `QUEUED`.
//! 4. **Prepare.** The coordinator trains or loads the WordPiece vocabulary, tokenizes and
//!    shards the corpus into the job's folder (`PREPARING`), then waits until `min_workers`
//!    idle workers are registered (`WAITING_FOR_WORKERS`). It takes up to `max_workers`,
//!    ordered by registration: that order is the rank order and the ring order. It builds each
//!    rank's shard (exactly the sequences `WorkerPlan::sequence_indices()` names) and computes
//!    every file's sha256.
//! 5. **Assign.** Each worker holds an `Attach` server stream open; the coordinator sends it
//!    `StartJob{key (generation 1, step 0), rank, world_size, peers (advertise addresses in rank
//!    order), spec, model config.json, total_sequences, files, ring settings, start_step,
//!    state_source, global_batch_size}`. The job is `RUNNING`. The first generation fixes the
//!    job's global batch `B = W * b * k`; later generations keep it.
//! 6. **Fetch data.** The worker streams each listed file with `FetchFile` in 1 MiB chunks,
//!    verifies its sha256 and caches it in `--cache-dir` under its checksum (a second job on
//!    the same data fetches nothing). Workers share no file system with anyone.
//! 7. **Initial weights.** Every rank builds the same parameters: `init_params(config, layout,
//!    seed)` from the job seed, or the `init_weights` file (an HF `model.safetensors`, from
//!    `init_checkpoint`) fetched in step 6. No broadcast is needed: the inputs are identical.
//! 8. **Train.** Ranks connect the ring (`Ring::connect` to the `peers`) and run steps. Each
//!    step: collate the micro-batches of `WorkerPlan::micro_batch(step, j)`; all-reduce the
//!    masked and NSP counts; forward/backward with `mlm_scale = 1/global_mlm_count`; gradient
//!    buckets go to the ring as they become final (overlapping backward); all-reduce the loss
//!    sums; clip by global norm; optimizer step with the schedule's learning rate. Every rank
//!    applies the same update to the same weights — or, when the summed loss or gradient is not
//!    finite, every rank skips the update (the step still counts; `StepReport.skipped`). A peer
//!    that stops answering makes the ring call fail within the ring timeout (the job's
//!    `peer_timeout_seconds`); the worker then sends `ReportFailure{recoverable: true}` naming
//!    the peer and the step, and keeps its state (step 14).
//! 9. **Report.** Rank 0 sends `ReportStep` after every step (the loss is global after the
//!    all-reduce, so one rank's report is enough); all ranks report liveness by heartbeat.
//!    Every `eval_every` steps all ranks evaluate their slice of the heldout set, all-reduce
//!    the sums, and rank 0 sends `ReportEval`. The coordinator appends both to the job's
//!    `metrics.jsonl`.
//! 10. **Checkpoint.** Every `checkpoint_every` steps and at the end, rank 0 streams
//!     `model.safetensors`, `optimizer.safetensors` and `trainer_state.json` with
//!     `UploadCheckpoint` (chunks carry the key, each file ends with its sha256). The
//!     coordinator verifies each file, adds `config.json` and the tokenizer files, writes a
//!     `manifest.json` of sha256 sums, fsyncs and renames the folder into place.
//! 11. **Finish.** Each rank sends `ReportDone` after its last step (rank 0 after its final
//!     upload). When all have, the job is `COMPLETED`. A `ReportFailure`, a dead worker or a
//!     client's `CancelJob` ends the job `FAILED`/`CANCELLED`; the coordinator sends `CancelJob`
//!     on the other workers' streams, and they drop the job and become idle.
//! 12. **Watch.** `WatchJob` streams `JobStatus` snapshots as the job advances until it ends.
//! 13. **Pull.** `PullCheckpoint{job, step}` streams a stored checkpoint's files in chunks,
//!     each file ending with its sha256; the client verifies them and writes the folder
//!     atomically. `PullMetrics` streams `metrics.jsonl` the same way, `PullTensorboard`
//!     the job's TensorBoard event files.
//! 14. **Recover.** On a lost worker, a recoverable `ReportFailure`, a coordinator restart or
//!     a new worker for a job below `max_workers`, the coordinator bumps the job's generation
//!     (`RECOVERING`) and sends every member `Suspend{key (new generation)}`. A member aborts
//!     its pending all-reduce at once, keeps its replica — weights and optimizer state after
//!     its last completed step — and answers `ReportHeld{key, held_steps}`. Members that do
//!     not answer within `peer_timeout_seconds` are dropped. With at least `min_workers`
//!     (members first, then idle workers; waiting at most `replacement_timeout_seconds`), it
//!     sends `StartJob` for the new generation with `start_step` = the newest step any member
//!     holds and `state_source = MEMORY`: ranks holding that step keep it, and
//!     `state_root_rank` broadcasts it to the others before the first step (an all-reduce
//!     where every other rank adds `-0.0`, which changes no bit). With no replica left it uses
//!     `CHECKPOINT` (the last stored checkpoint's files) or `INIT` (step 0). If the upload of
//!     the checkpoint at `start_step` was lost, `checkpoint_first` makes rank 0 upload it
//!     again. Each rank's shard is rebuilt for the new world with the same global batch
//!     (`split::WorkerPlan::with_global_batch`). At most `max_recoveries` recoveries.
//!
//! # Timeouts
//! A dead worker is noticed by its ring neighbours (a refused connection at once, silence
//! within `peer_timeout_seconds`, default 30 s) and by the coordinator (its `Attach` stream
//! closing, at once for a dead process; no heartbeat for `peer_timeout_seconds` for a cut
//! link): recovery (or, with `max_recoveries = 0`, failure) starts within
//! `peer_timeout_seconds` plus one heartbeat interval ([`HEARTBEAT_INTERVAL`]) and one
//! tick of the coordinator's state machine (0.25 s). Eval and checkpoint staging happen between ring calls, so they
//! must take less than the timeout.
//!
//! A job whose workers heartbeat but do not step is noticed by the coordinator's progress
//! watchdog: no new step (rank 0's reports or a member's heartbeat), evaluation or checkpoint
//! chunk for `progress_timeout_seconds` (default 600 s) starts a recovery (step 14) without the
//! members that never started the generation or lag behind it, or fails the job naming them.

use std::time::Duration;

/// How often workers heartbeat.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// Silence after which the coordinator declares an idle worker dead (a worker in a job gets
/// the job's `peer_timeout_seconds`).
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);

/// Bytes per chunk in file streams (well under tonic's 4 MiB message limit).
pub const FILE_CHUNK_BYTES: usize = 1 << 20;

/// Largest message either side accepts (bytes): a chunk plus headroom.
pub const MAX_MESSAGE_BYTES: usize = 8 << 20;
