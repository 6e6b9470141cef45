//! Strangers and bad requests: every call needs the cluster token (health excepted), and TLS
//! works end to end. Real processes on 127.0.0.1.

mod common;

use common::*;
use keel_proto::ring_rpc::RingFrame;
use keel_proto::ring_rpc::ring_client::RingClient;
use keel_proto::rpc::ListJobsRequest;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// `keel ARGS` with `token` as KEEL_TOKEN_FILE (none: unset), not asserting success.
fn keel_with_token(args: &[&str], cwd: &Path, token: Option<&Path>) -> Output {
    let mut c = Command::new(keel());
    c.args(args).current_dir(cwd).stdin(Stdio::null());
    match token {
        Some(t) => c.env("KEEL_TOKEN_FILE", t),
        None => c.env_remove("KEEL_TOKEN_FILE"),
    };
    c.output().unwrap()
}

/// A token file that is not the cluster's.
fn wrong_token(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("wrong.token");
    keel_net::auth::ClusterToken::create_file(&path).unwrap();
    path
}

/// Polls the log of `p` until it contains `needle` `times` times (at most 60 s).
fn wait_for_log(p: &Proc, needle: &str, times: usize) -> String {
    poll(Duration::from_secs(60), || {
        let text = p.log_text();
        (text.matches(needle).count() >= times).then_some(text)
    })
    .unwrap_or_else(|| {
        panic!(
            "{} never logged {needle:?} {times}x:\n{}",
            p.name,
            p.log_text()
        )
    })
}

#[test]
fn keel_jobs_needs_the_right_token_and_refusals_are_logged() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (coordinator, addr) = start_coordinator(root);
    // Wait until it serves (the right token works).
    let ok = poll(Duration::from_secs(30), || {
        let out = keel_with_token(&["jobs", "--coordinator", &addr], root, Some(token_file()));
        out.status.success().then_some(out)
    })
    .expect("keel jobs with the right token never succeeded");
    assert!(String::from_utf8_lossy(&ok.stdout).starts_with("job"));

    // No token file: the client refuses to start, saying how to make one.
    let out = keel_with_token(&["jobs", "--coordinator", &addr], root, None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("no cluster token") && err.contains("head -c 32"),
        "{err}"
    );

    // A wrong token: the coordinator refuses, the client says so plainly, the log names it.
    let wrong = wrong_token(root);
    let out = keel_with_token(&["jobs", "--coordinator", &addr], root, Some(&wrong));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("refused the cluster token"), "{err}");
    let log = wait_for_log(&coordinator, "refused: wrong cluster token", 1);
    assert!(log.contains("/keel.v1.Coordinator/ListJobs"), "{log}");
    assert!(log.contains("remote=127.0.0.1:"), "{log}");

    // A raw gRPC call without any token: UNAUTHENTICATED, logged.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let status = rt.block_on(async {
        let mut client = CoordinatorClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        client.list_jobs(ListJobsRequest {}).await.unwrap_err()
    });
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    wait_for_log(&coordinator, "refused: no cluster token", 1);
}

#[test]
fn a_worker_with_a_wrong_token_is_not_registered_and_ring_pushes_need_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (coordinator, addr) = start_coordinator(root);
    let wrong = wrong_token(root);
    let (stranger, _) = start_worker_with(
        root,
        &addr,
        0,
        &["--token-file".into(), wrong.display().to_string()],
    );
    // The stranger is refused, says so, and retries (with a growing pause).
    wait_for_log(&stranger, "refused this worker", 2);
    let log = wait_for_log(&coordinator, "/keel.v1.Coordinator/Register", 2);
    assert!(!log.contains("worker registered"), "{log}");

    // A member worker registers; its ring port refuses pushes without the token.
    let (member, member_addr) = start_worker(root, &addr, 1);
    wait_for_log(&member, "registered", 1);
    let log = coordinator.log_text();
    assert_eq!(log.matches("worker registered").count(), 1, "{log}");

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{member_addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        // Health stays open without a token (Kubernetes probes cannot send one).
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
        let reply = health
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            reply.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );

        let mut ring = RingClient::new(channel.clone());
        let status = ring.push(RingFrame::default()).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");

        // With the token the push reaches the ring service, which judges the frame itself.
        let token = keel_net::auth::ClusterToken::load(token_file()).unwrap();
        let mut ring =
            RingClient::new(keel_net::security::ClientSecurity::new(&token, None).wrap(channel));
        let status = ring.push(RingFrame::default()).await.unwrap_err();
        assert_ne!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    });
    wait_for_log(&member, "/keel.ring.v1.Ring/Push", 1);
}

/// A self-signed certificate for 127.0.0.1 and localhost: (cert.pem, key.pem) in `dir`.
fn self_signed(dir: &Path) -> (String, String) {
    let key =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
    let cert = dir.join("cert.pem");
    let key_path = dir.join("key.pem");
    std::fs::write(&cert, key.cert.pem()).unwrap();
    std::fs::write(&key_path, key.signing_key.serialize_pem()).unwrap();
    (cert.display().to_string(), key_path.display().to_string())
}

#[test]
fn a_small_cluster_trains_over_tls_and_plaintext_clients_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (cert, key) = self_signed(root);
    let server = vec![
        "--tls-cert".to_string(),
        cert.clone(),
        "--tls-key".into(),
        key,
    ];
    let mut worker = server.clone();
    worker.extend(["--tls-ca".to_string(), cert.clone()]);
    let (_coordinator, addr) = start_coordinator_with(root, &server);
    let _workers = [
        start_worker_with(root, &addr, 0, &worker),
        start_worker_with(root, &addr, 1, &worker),
    ];
    let text = std::fs::read_to_string(corpus("en-kjv").join("kjv.txt")).unwrap();
    let part: Vec<&str> = text.lines().take(1500).collect();
    let corpus_path = root.join("kjv-part.txt");
    std::fs::write(&corpus_path, part.join("\n") + "\n").unwrap();
    let mut job = JobFile::new(corpus_path);
    job.vocab_size = 300;
    job.max_steps = 4;
    job.warmup_steps = 1;
    job.checkpoint_every = 0;
    job.eval_every = 0;
    let job_path = job.write(root);
    let tls = ["--tls-ca", cert.as_str()];
    let out = run_keel(
        &[
            "submit",
            job_path.to_str().unwrap(),
            "--coordinator",
            &addr,
            tls[0],
            tls[1],
        ],
        root,
    );
    let job_id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    run_keel(
        &["watch", &job_id, "--coordinator", &addr, tls[0], tls[1]],
        root,
    );
    let out = run_keel(
        &["status", &job_id, "--coordinator", &addr, tls[0], tls[1]],
        root,
    );
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["state"], "completed", "{status}");
    assert_eq!(status["step"], 4, "{status}");

    // A plaintext client (right token, no --tls-ca) gets nowhere, and says why. How the server
    // breaks off differs from call to call (a framing error, or a closed socket that once killed
    // keel silently by SIGPIPE: CI, 2026-11-30), so try several times.
    for attempt in 0..8 {
        let out = keel_with_token(&["jobs", "--coordinator", &addr], root, Some(token_file()));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "attempt {attempt}: {} (a signal ends with no code)\nstdout: {}\nstderr: {err}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(err.contains("--tls-ca"), "attempt {attempt}: {err}");
    }
}
