//! The coordinator's gRPC service in-process on 127.0.0.1: job submission and validation,
//! cancellation ending a watch, worker registration and heartbeats.

use keel_net::auth::{AuthChannel, ClusterToken};
use keel_net::security::{ClientSecurity, ServerSecurity};
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::*;
use std::time::Duration;
use tonic::transport::Channel;

#[path = "../../fixtures/testdata.rs"]
mod testdata;

/// A coordinator on a free port over a temporary data folder; stopped when the sender drops.
async fn start() -> (
    CoordinatorClient<AuthChannel>,
    tokio::sync::oneshot::Sender<()>,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let token = ClusterToken::create_file(&dir.path().join("keel.token")).unwrap();
    let config = keel_coordinator::Config {
        data_dir: dir.path().to_path_buf(),
        security: ServerSecurity::new(token.clone(), None),
        input_roots: Default::default(),
        metrics_listener: None,
    };
    tokio::spawn(keel_coordinator::run(config, listener, async move {
        let _ = rx.await;
    }));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = ClientSecurity::new(&token, None).wrap(channel);
    (CoordinatorClient::new(client), tx, dir)
}

fn job_toml(extra_train: &str) -> String {
    let corpus = testdata::corpus("en-kjv");
    let corpus = corpus.display();
    format!(
        "[data]\ncorpus = [\"{corpus}\"]\nvocab_size = 500\nmax_seq_length = 64\n[model]\npreset = \"tiny\"\n[train]\nmicro_batch_size = 4\nmax_steps = 10\n{extra_train}\n[cluster]\nmin_workers = 2\nmax_workers = 2\n"
    )
}

#[tokio::test]
async fn an_invalid_job_is_refused_naming_the_key() {
    let (mut client, _stop, _dir) = start().await;
    let err = client
        .submit_job(SubmitJobRequest {
            spec_toml: job_toml("learning_rat = 0.1"),
            origin: "bad.toml".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("learning_rat"), "{}", err.message());
    assert!(err.message().contains("bad.toml"), "{}", err.message());
    let jobs = client
        .list_jobs(ListJobsRequest {})
        .await
        .unwrap()
        .into_inner()
        .jobs;
    assert!(jobs.is_empty());
}

#[tokio::test]
async fn a_job_waits_for_workers_and_cancelling_it_ends_its_watch() {
    let (mut client, _stop, dir) = start().await;
    let id = client
        .submit_job(SubmitJobRequest {
            spec_toml: job_toml(""),
            origin: "job.toml".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .job_id;
    assert!(dir.path().join("jobs").join(&id).join("job.toml").is_file());
    // No worker is registered: the job is prepared, then waits.
    let mut watch = client
        .watch_job(GetJobRequest { job_id: id.clone() })
        .await
        .unwrap()
        .into_inner();
    let mut waited = false;
    for _ in 0..600 {
        let s = client
            .get_job(GetJobRequest { job_id: id.clone() })
            .await
            .unwrap()
            .into_inner();
        assert_ne!(s.state, JobState::Failed as i32, "{}", s.error);
        if s.state == JobState::WaitingForWorkers as i32 {
            waited = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(waited, "the job never got to waiting for workers");
    let prepared = dir.path().join("jobs").join(&id).join("data");
    assert!(prepared.join("vocab.txt").is_file() && prepared.join("heldout.keel").is_file());
    assert!(
        dir.path()
            .join("jobs")
            .join(&id)
            .join("config.json")
            .is_file()
    );

    let s = client
        .cancel_job(CancelJobRequest { job_id: id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.state, JobState::Cancelled as i32);
    let mut last = None;
    while let Some(s) = tokio::time::timeout(Duration::from_secs(10), watch.message())
        .await
        .expect("the watch stream ends after the job ends")
        .unwrap()
    {
        last = Some(s);
    }
    assert_eq!(last.unwrap().state, JobState::Cancelled as i32);
    // Pulling a job without checkpoints says so.
    let Err(err) = client
        .pull_checkpoint(PullCheckpointRequest {
            job_id: id,
            step: 0,
        })
        .await
    else {
        panic!("a job without checkpoints streamed one");
    };
    assert_eq!(err.code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn workers_register_with_an_explicit_address_and_heartbeat() {
    let (mut client, _stop, _dir) = start().await;
    let err = client
        .register(RegisterRequest {
            advertise_addr: String::new(),
            threads: 1,
            hostname: "h".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let reply = client
        .register(RegisterRequest {
            advertise_addr: "127.0.0.1:9".into(),
            threads: 1,
            hostname: "h".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(reply.heartbeat_timeout_ms > reply.heartbeat_interval_ms);
    let known = client
        .heartbeat(HeartbeatRequest {
            worker_id: reply.worker_id.clone(),
            key: None,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .known;
    assert!(known);
    let unknown = client
        .heartbeat(HeartbeatRequest {
            worker_id: "w-999".into(),
            key: None,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .known;
    assert!(!unknown, "an unknown worker must be told to register again");
}
