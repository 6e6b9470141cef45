//! Abuse cases 6 (b, c) and 7 (duplicate addresses, held-step claims) against a real
//! coordinator process, spoken to over raw gRPC as a hostile client or fake worker would:
//! errors quote only a bounded prefix of the input; control characters in client strings do
//! not forge log lines; a second live registration of one advertise address is refused while
//! a restarted worker on that address is accepted; a held-step claim past the job's last step
//! is ignored.

mod common;

use common::*;
use keel_net::auth::AuthChannel;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::*;
use std::time::{Duration, Instant};
use tonic::Streaming;

/// A client of the coordinator at `addr` with the test cluster token.
async fn client(addr: &str) -> CoordinatorClient<AuthChannel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let token = keel_net::auth::ClusterToken::load(token_file()).unwrap();
    CoordinatorClient::new(keel_net::security::ClientSecurity::new(&token, None).wrap(channel))
        .max_decoding_message_size(64 << 20)
}

/// A registration as a worker would send it.
fn registration(addr: &str) -> RegisterRequest {
    RegisterRequest {
        advertise_addr: addr.into(),
        threads: 1,
        hostname: "fake".into(),
        ..Default::default()
    }
}

#[test]
fn errors_quote_only_a_bounded_prefix_of_the_input() {
    let dir = tempfile::tempdir().unwrap();
    let (_coordinator, addr) = start_coordinator(dir.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = client(&addr).await;
        // The case: a 4 MB key (it came back as a 14 MB grpc-message), and a 1 MB origin.
        let key = "k".repeat(4 << 20);
        let status = c
            .submit_job(SubmitJobRequest {
                spec_toml: format!("[data]\n{key} = 1\n"),
                origin: "o".repeat(1 << 20),
            })
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{}",
            &status.message()[..200.min(status.message().len())]
        );
        let message = status.message();
        assert!(message.len() < 2048, "{} bytes came back", message.len());
        assert!(message.contains("bytes more"), "{message}");
    });
}

#[test]
fn control_characters_in_client_strings_cannot_forge_log_lines() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (coordinator, addr) = start_coordinator(root);
    // A corpus whose name carries a line break and a forged record; it fails preparation, and
    // the failure (logged) names it.
    let forged = "x\n2026-12-01T00:00:00.000000Z ERROR keel_coordinator: FORGED-PATH .jsonl";
    let corpus = root.join(forged);
    std::fs::write(&corpus, "not json\n").unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = client(&addr).await;
        c.register(RegisterRequest {
            hostname: "h\nFORGED-HOST".into(),
            bf16_detail: "d\r\nFORGED-DETAIL".into(),
            ..registration("127.0.0.1:9\nFORGED-ADDR")
        })
        .await
        .unwrap();
        let toml = format!(
            "[data]\ncorpus = [{:?}]\nvocab_size = 300\n[model]\npreset = \"tiny\"\n\
             [train]\nmicro_batch_size = 2\nmax_steps = 3\n",
            corpus.display().to_string()
        );
        c.submit_job(SubmitJobRequest {
            spec_toml: toml,
            origin: "job.toml\nFORGED-ORIGIN".into(),
        })
        .await
        .unwrap();
    });
    // The preparation's failure names the corpus file (and the line it could not parse).
    let log = poll(Duration::from_secs(60), || {
        let log = coordinator.log_text();
        log.contains("expected a JSON object").then_some(log)
    })
    .unwrap_or_else(|| panic!("the failure was not logged:\n{}", coordinator.log_text()));
    assert!(log.contains("worker registered"), "{log}");
    for line in log.lines() {
        assert!(
            !line.trim_start().starts_with("FORGED")
                && !line.starts_with("2026-12-01T00:00:00.000000Z"),
            "a forged line:\n{line}\nin:\n{log}"
        );
    }
    assert!(
        log.contains("\\nFORGED-HOST") && log.contains("\\nFORGED-ADDR"),
        "{log}"
    );
    assert!(
        log.contains("x\\n2026-12-01T00:00:00.000000Z ERROR keel_coordinator: FORGED-PATH"),
        "{log}"
    );
}

/// Reads the next command on `commands` (at most `limit`).
async fn next_command(
    commands: &mut Streaming<WorkerCommand>,
    limit: Duration,
) -> worker_command::Command {
    tokio::time::timeout(limit, commands.message())
        .await
        .expect("no command in time")
        .unwrap()
        .expect("the command stream ended")
        .command
        .expect("an empty command")
}

#[test]
fn a_held_step_claim_past_the_jobs_last_step_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (coordinator, addr) = start_coordinator(root);
    let corpus = kjv_lines(root, 400);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = client(&addr).await;
        let id = c
            .register(registration("127.0.0.1:9"))
            .await
            .unwrap()
            .into_inner()
            .worker_id;
        let mut commands = c
            .attach(AttachRequest {
                worker_id: id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        let beat = {
            let (mut c, id) = (c.clone(), id.clone());
            tokio::spawn(async move {
                loop {
                    let _ = c
                        .heartbeat(HeartbeatRequest {
                            worker_id: id.clone(),
                            key: None,
                            ..Default::default()
                        })
                        .await;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            })
        };
        let toml = format!(
            "[data]\ncorpus = [{:?}]\nvocab_size = 300\nmax_seq_length = 64\n\
             max_predictions_per_seq = 10\n[model]\npreset = \"tiny\"\n[train]\n\
             micro_batch_size = 2\nmax_steps = 10\n",
            corpus.display().to_string()
        );
        c.submit_job(SubmitJobRequest {
            spec_toml: toml,
            origin: "job.toml".into(),
        })
        .await
        .unwrap();
        let worker_command::Command::Start(start) =
            next_command(&mut commands, Duration::from_secs(120)).await
        else {
            panic!("expected StartJob");
        };
        let key = start.key.unwrap();
        assert_eq!(start.state_source, StateSource::Init as i32);
        // A ring failure claiming an absurd held step (the failure report's held steps answer
        // the Suspend of the next generation), then the same claim as the Suspend's answer.
        c.report_failure(FailureReport {
            key: Some(key.clone()),
            rank: 0,
            worker_id: id.clone(),
            error: "forced".into(),
            recoverable: true,
            held_steps: vec![u64::MAX],
        })
        .await
        .unwrap();
        let worker_command::Command::Suspend(suspend) =
            next_command(&mut commands, Duration::from_secs(30)).await
        else {
            panic!("expected Suspend");
        };
        let generation = suspend.key.as_ref().unwrap().generation;
        // The failure report may already have completed the collection (this is the job's only
        // worker): then the generation is formed and this answer is refused as stale.
        if let Err(status) = c
            .report_held(HeldReport {
                key: suspend.key.clone(),
                worker_id: id.clone(),
                held_steps: vec![u64::MAX],
            })
            .await
        {
            assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
        }
        let worker_command::Command::Start(again) =
            next_command(&mut commands, Duration::from_secs(30)).await
        else {
            panic!("expected StartJob of the new generation");
        };
        assert_eq!(again.key.as_ref().unwrap().generation, generation);
        assert_eq!(
            (again.start_step, again.state_source),
            (0, StateSource::Init as i32),
            "the claim was trusted"
        );
        beat.abort();
    });
    let log = coordinator.log_text();
    assert!(
        log.contains("held-step claim past the job's last step ignored"),
        "{log}"
    );
}

#[test]
fn a_second_live_registration_of_an_address_is_refused_but_a_restarted_worker_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (coordinator, addr) = start_coordinator(root);
    let (mut worker, worker_addr) = start_worker(root, &addr, 0);
    poll(Duration::from_secs(60), || {
        coordinator
            .log_text()
            .contains("worker registered")
            .then_some(())
    })
    .expect("the worker never registered");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = client(&addr).await;
        let status = c.register(registration(&worker_addr)).await.unwrap_err();
        assert_eq!(
            status.code(),
            tonic::Code::AlreadyExists,
            "{}",
            status.message()
        );
        assert!(
            status.message().contains(&worker_addr),
            "{}",
            status.message()
        );
        // A different address is fine.
        c.register(registration("127.0.0.1:9")).await.unwrap();
    });
    // The worker dies and a new process starts on the same address: accepted.
    worker.child.kill().unwrap();
    worker.child.wait().unwrap();
    let _again = Proc::spawn(
        "worker-0-again",
        &sibling("keel-worker"),
        &[
            "--coordinator".to_string(),
            addr.clone(),
            "--listen".into(),
            worker_addr.clone(),
            "--advertise-addr".into(),
            worker_addr.clone(),
            "--threads".into(),
            "1".into(),
            "--cache-dir".into(),
            root.join("worker-0").display().to_string(),
        ],
        &root.join("logs"),
    );
    let needle = format!("({worker_addr})");
    let started = Instant::now();
    poll(Duration::from_secs(60), || {
        let log = coordinator.log_text();
        let registered = log
            .lines()
            .filter(|l| l.contains("worker registered") && l.contains(&needle))
            .count();
        (registered == 2).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "the restarted worker was not accepted:\n{}",
            coordinator.log_text()
        )
    });
    assert!(started.elapsed() < Duration::from_secs(30));
}
