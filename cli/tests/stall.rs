//! Abuse case 7 (`scripts/abuse.sh`): a job that makes no progress is noticed. A fake worker, written here,
//! registers with a real coordinator process over gRPC with the cluster token, attaches and
//! heartbeats, but ignores its `StartJob`: before the progress watchdog such a job stayed
//! `running, step 0` for ever. With `[cluster] progress_timeout_seconds`, the job fails naming
//! the stalled worker (recovery off), or re-forms without it and completes on a real worker.

mod common;

use common::*;
use keel_net::auth::AuthChannel;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::*;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A client of the coordinator at `addr` with the test cluster token.
async fn client(addr: &str) -> CoordinatorClient<AuthChannel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let token = keel_net::auth::ClusterToken::load(token_file()).unwrap();
    CoordinatorClient::new(keel_net::security::ClientSecurity::new(&token, None).wrap(channel))
}

/// A worker that registers, attaches and heartbeats (naming no job) every 300 ms, and never
/// steps: it only records the commands it is sent. Its tasks end with the runtime.
struct FakeWorker {
    /// Its worker id.
    id: String,
    /// The advertise address it registered (nothing listens there).
    addr: String,
    /// `start`, `suspend`, `cancel` for each command received, in order.
    commands: Arc<Mutex<Vec<&'static str>>>,
}

impl FakeWorker {
    async fn start(coordinator: &str) -> FakeWorker {
        let mut c = client(coordinator).await;
        let addr = format!("127.0.0.1:{}", free_port());
        let id = c
            .register(RegisterRequest {
                advertise_addr: addr.clone(),
                threads: 1,
                hostname: "fake".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .worker_id;
        let mut stream = c
            .attach(AttachRequest {
                worker_id: id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        let commands = Arc::new(Mutex::new(Vec::new()));
        let seen = commands.clone();
        tokio::spawn(async move {
            while let Ok(Some(cmd)) = stream.message().await {
                let name = match cmd.command {
                    Some(worker_command::Command::Start(_)) => "start",
                    Some(worker_command::Command::Suspend(_)) => "suspend",
                    Some(worker_command::Command::Cancel(_)) => "cancel",
                    None => "empty",
                };
                seen.lock().unwrap().push(name);
            }
        });
        let beat_id = id.clone();
        tokio::spawn(async move {
            loop {
                let _ = c
                    .heartbeat(HeartbeatRequest {
                        worker_id: beat_id.clone(),
                        key: None,
                        ..Default::default()
                    })
                    .await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        });
        FakeWorker { id, addr, commands }
    }

    fn commands(&self) -> Vec<&'static str> {
        self.commands.lock().unwrap().clone()
    }
}

/// Submits a one-worker job of 5 steps on part of the KJV with `cluster_extra`; its id.
fn submit(root: &Path, coordinator: &str, cluster_extra: &str) -> String {
    let mut job = common::JobFile::new(kjv_lines(root, 1000));
    job.vocab_size = 500;
    job.workers = 1;
    job.max_steps = 5;
    job.warmup_steps = 1;
    job.checkpoint_every = 0;
    job.eval_every = 0;
    job.cluster_extra = cluster_extra.into();
    let path = job.write(root);
    let out = run_keel(
        &[
            "submit",
            path.to_str().unwrap(),
            "--coordinator",
            coordinator,
        ],
        root,
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Waits (at most 120 s: data preparation) until the job runs on `fake`; when it started.
fn running_on(job: &str, coordinator: &str, root: &Path, fake: &FakeWorker) -> Instant {
    poll(Duration::from_secs(120), || {
        let s = status(job, coordinator, root);
        let on_fake = s["workers"]
            .as_array()?
            .iter()
            .any(|w| w.as_str().is_some_and(|w| w.contains(&fake.addr)));
        (s["state"] == "running" && on_fake).then(Instant::now)
    })
    .unwrap_or_else(|| {
        panic!(
            "the job never ran on the fake worker: {}",
            status(job, coordinator, root)
        )
    })
}

/// The `stall` events of the job's metrics.jsonl.
fn stall_events(root: &Path, job: &str) -> Vec<serde_json::Value> {
    metrics(
        &root
            .join("coordinator/jobs")
            .join(job)
            .join("metrics.jsonl"),
    )
    .into_iter()
    .filter(|m| m["event"] == "stall")
    .collect()
}

#[test]
fn a_job_whose_worker_never_steps_fails_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (coordinator, addr) = start_coordinator(root);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let fake = rt.block_on(FakeWorker::start(&addr));
    let job = submit(
        root,
        &addr,
        "max_recoveries = 0\nprogress_timeout_seconds = 3",
    );
    let running = running_on(&job, &addr, root, &fake);
    let failed = poll(Duration::from_secs(60), || {
        let s = status(&job, &addr, root);
        (s["state"] == "failed").then_some(s)
    })
    .unwrap_or_else(|| {
        panic!(
            "the stalled job was not noticed: {}\ncoordinator log:\n{}",
            status(&job, &addr, root),
            coordinator.log_text()
        )
    });
    let waited = running.elapsed();
    assert!(
        waited >= Duration::from_secs(2),
        "failed after {waited:?}, before its timeout"
    );
    assert_eq!(failed["step"], 0);
    let error = failed["error"].as_str().unwrap();
    for needle in [
        format!("job {job} made no progress"),
        "progress_timeout_seconds = 3".into(),
        "generation 1 is at step 0, step 1 never came".into(),
        format!("{} ({}) (never started generation 1)", fake.id, fake.addr),
    ] {
        assert!(error.contains(&needle), "{needle:?} not in: {error}");
    }
    let stalls = stall_events(root, &job);
    assert_eq!(stalls.len(), 1, "{stalls:?}");
    assert_eq!(stalls[0]["dropped"], serde_json::json!([fake.id]));
    // It was told to drop the generation it never started.
    assert!(fake.commands().contains(&"cancel"), "{:?}", fake.commands());
    assert!(coordinator.log_text().contains("made no progress"));
}

#[test]
fn a_stalled_job_reforms_without_the_stalled_worker_and_completes() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (coordinator, addr) = start_coordinator(root);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let fake = rt.block_on(FakeWorker::start(&addr));
    // Room for one slow first step of the real worker on a loaded machine as well.
    let job = submit(
        root,
        &addr,
        "max_recoveries = 4\nprogress_timeout_seconds = 5",
    );
    running_on(&job, &addr, root, &fake);
    // A real worker registers after the fake one holds the job: idle, it is the replacement.
    let (_worker, worker_addr) = start_worker(root, &addr, 0);
    let done = poll(Duration::from_secs(180), || {
        let s = status(&job, &addr, root);
        matches!(s["state"].as_str(), Some("completed" | "failed")).then_some(s)
    })
    .unwrap_or_else(|| {
        panic!(
            "the stalled job did not re-form and finish: {}\ncoordinator log:\n{}",
            status(&job, &addr, root),
            coordinator.log_text()
        )
    });
    assert_eq!(
        done["state"],
        "completed",
        "{done}\n{}",
        coordinator.log_text()
    );
    assert_eq!(done["step"], 5);
    assert!(done["recoveries"].as_u64().unwrap() >= 1, "{done}");
    let workers = done["workers"].to_string();
    assert!(
        workers.contains(&worker_addr) && !workers.contains(&fake.addr),
        "{workers}"
    );
    let stalls = stall_events(root, &job);
    assert_eq!(
        stalls[0]["dropped"],
        serde_json::json!([fake.id]),
        "{stalls:?}"
    );
    assert!(fake.commands().contains(&"cancel"), "{:?}", fake.commands());
}
