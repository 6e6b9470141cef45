//! Issue 19, finding 6 (b, c) against a real coordinator process, spoken to over raw gRPC as
//! a hostile client would: errors quote only a bounded prefix of the input; control
//! characters in client strings do not forge log lines.

mod common;

use common::*;
use keel_proto::auth::AuthChannel;
use keel_proto::rpc::coordinator_client::CoordinatorClient;
use keel_proto::rpc::*;
use std::time::Duration;

/// A client of the coordinator at `addr` with the test cluster token.
async fn client(addr: &str) -> CoordinatorClient<AuthChannel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let token = keel_proto::auth::ClusterToken::load(token_file()).unwrap();
    CoordinatorClient::new(keel_proto::security::ClientSecurity::new(&token, None).wrap(channel))
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
