//! No one without the token can lock the cluster out. A stranger on 127.0.0.1 (the test
//! itself) holds 1,000 connections against each of the coordinator's gRPC port, its HTTP port
//! and a worker's ring port ([`attack`]: HTTP/2 prefaces answering PINGs, keep-alive
//! `/healthz` requests; closed ones are opened again). Meanwhile `keel jobs` answers within
//! 5 s, a new worker registers within 15 s, `/metrics` answers, and a job whose ring runs
//! through the held ring port completes, with a worker killed mid-job and replaced, losing at
//! most the step in flight. The servers' cap is the default 512: before
//! unauthenticated connections could be evicted, all four failed.

#[path = "common/attack.rs"]
mod attack;
mod common;

use attack::{Counts, Port};
use common::*;
use std::io::{Read, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Connections the stranger holds against each port.
const HELD: usize = 1000;

/// `keel jobs` against `addr`: whether it succeeded, how long it took and its stderr.
fn timed_keel_jobs(addr: &str, cwd: &std::path::Path) -> (bool, Duration, String) {
    let started = Instant::now();
    let out = keel_jobs(addr, cwd);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    (out.status.success(), started.elapsed(), stderr)
}

/// `GET path` on `127.0.0.1:port`: the status code (0: no HTTP answer) and how long it took.
fn http_get(port: u16, path: &str) -> (u16, Duration) {
    let started = Instant::now();
    let code = (|| {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        let reply = String::from_utf8_lossy(&reply);
        reply.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
    })()
    .unwrap_or(0);
    (code, started.elapsed())
}

fn describe(what: &str, c: &Counts) -> String {
    format!(
        "{what}: {} open, {} opened, {} pings answered, {} requests answered",
        c.open.load(Ordering::Relaxed),
        c.opened.load(Ordering::Relaxed),
        c.pings.load(Ordering::Relaxed),
        c.answers.load(Ordering::Relaxed)
    )
}

#[test]
fn strangers_holding_every_port_lock_no_one_out() {
    // 3,000 held connections here, plus the servers' own: raise the limit of this process
    // (the servers inherit it).
    let nofile = attack::raise_nofile(8192);
    assert!(
        nofile >= 4096,
        "the open-file limit is {nofile}: this test needs 4,096 (ulimit -n)"
    );
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let http_port = free_port();
    let (coordinator, addr) = start_coordinator_with(
        root,
        &["--metrics-listen".into(), format!("127.0.0.1:{http_port}")],
    );
    let (w0, ring) = start_worker(root, &addr, 0);
    let registered = |w: &Proc, limit| {
        poll(limit, || w.log_text().contains("registered").then_some(())).is_some()
    };
    assert!(
        registered(&w0, Duration::from_secs(60)),
        "{}",
        w0.log_text()
    );
    let coordinator_nofile = attack::nofile_of(coordinator.child.id());
    assert!(
        coordinator_nofile.is_some_and(|n| n > 2 * 512),
        "the coordinator's open-file limit is {coordinator_nofile:?}"
    );
    // Before the attack: everything answers.
    assert!(timed_keel_jobs(&addr, root).0);
    assert_eq!(http_get(http_port, "/metrics").0, 200);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(300);
    let on_grpc = attack::hold(&runtime, &addr, Port::Grpc, HELD, until);
    let on_ring = attack::hold(&runtime, &ring, Port::Grpc, HELD, until);
    let on_http = attack::hold(
        &runtime,
        &format!("127.0.0.1:{http_port}"),
        Port::Http,
        HELD,
        until,
    );
    let opened = poll(Duration::from_secs(60), || {
        [&on_grpc, &on_ring, &on_http]
            .iter()
            .all(|c| c.opened.load(Ordering::Relaxed) >= HELD)
            .then_some(())
    });
    assert!(
        opened.is_some(),
        "the stranger could not open its connections"
    );
    // Let the servers fill up and the stranger re-open what they closed.
    std::thread::sleep(attack::REOPEN_PAUSE * 3);
    let state = || {
        [
            describe("coordinator gRPC", &on_grpc),
            describe("ring port", &on_ring),
            describe("HTTP port", &on_http),
        ]
        .join("; ")
    };
    let during = state();
    eprintln!("attack under way: {during}");

    // `keel jobs`, three times (each a new connection): each within 5 s.
    let jobs: Vec<_> = (0..3).map(|_| timed_keel_jobs(&addr, root)).collect();
    // A new worker registers within 15 s.
    let started = Instant::now();
    let (w1, _) = start_worker(root, &addr, 1);
    let w1_registered = registered(&w1, Duration::from_secs(15));
    let registration = started.elapsed();
    // `/metrics` answers, three times.
    let scrapes: Vec<_> = (0..3).map(|_| http_get(http_port, "/metrics")).collect();
    eprintln!(
        "keel jobs: {:?}; registration: {} after {registration:?}; /metrics: {scrapes:?}; {}",
        jobs.iter().map(|j| (j.0, j.1)).collect::<Vec<_>>(),
        if w1_registered {
            "registered"
        } else {
            "NOT registered"
        },
        state()
    );
    for (ok, took, stderr) in &jobs {
        assert!(
            *ok && *took < Duration::from_secs(5),
            "keel jobs under attack: ok {ok} after {took:?}: {stderr}\n{during}"
        );
    }
    assert!(
        w1_registered,
        "no registration within 15 s under attack:\n{}\n{during}",
        w1.log_text()
    );
    for (code, took) in &scrapes {
        assert!(
            *code == 200 && *took < Duration::from_secs(5),
            "/metrics under attack: {code} after {took:?}; {during}"
        );
    }

    // A job on both workers: its ring runs through worker 0's held ring port. Mid-job worker 1
    // is killed and a replacement registers; the newcomer must reach worker 0 through that
    // port to take the state the survivor holds. The job completes and loses at most the step
    // in flight: every resume is from memory (a survivor that could not reach the newcomer
    // used to drop its state, and the job went back to its last checkpoint).
    let mut job = JobFile::new(kjv_lines(root, 1500));
    job.vocab = Some(fixture("wordpiece").join("vocab.txt"));
    job.micro_batch_size = 4;
    job.max_steps = 400;
    job.warmup_steps = 2;
    job.checkpoint_every = 0;
    job.eval_every = 0;
    let path = job.write(root);
    let out = run_keel(
        &["submit", path.to_str().unwrap(), "--coordinator", &addr],
        root,
    );
    let job_id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let step_of = |s: &serde_json::Value| s["step"].as_u64().unwrap_or(0);
    let running = poll(Duration::from_secs(240), || {
        let s = status(&job_id, &addr, root);
        assert_ne!(s["state"], "failed", "{s}");
        (step_of(&s) >= 20 || s["state"] == "completed").then_some(s)
    })
    .expect("the job did not reach step 20 under attack");
    assert_ne!(
        running["state"], "completed",
        "the job ended before the kill: {running}"
    );
    let mut w1 = w1;
    let _ = w1.child.kill();
    let killed_at = step_of(&status(&job_id, &addr, root));
    let (_w2, _) = start_worker(root, &addr, 2);
    let done = poll(Duration::from_secs(300), || {
        let s = status(&job_id, &addr, root);
        assert_ne!(s["state"], "failed", "{s}\n{}", state());
        (s["state"] == "completed").then_some(s)
    });
    let done = done.unwrap_or_else(|| {
        panic!(
            "the job did not complete under attack: {}\n{}",
            status(&job_id, &addr, root),
            state()
        )
    });
    assert!(
        done["recoveries"].as_u64().unwrap_or(0) >= 1,
        "no recovery after the kill: {done}"
    );
    let pulled = root.join("pulled");
    run_keel(
        &[
            "pull",
            &job_id,
            "--out",
            pulled.to_str().unwrap(),
            "--coordinator",
            &addr,
        ],
        root,
    );
    let lines = metrics(&pulled.join("metrics.jsonl"));
    let resumes: Vec<&serde_json::Value> =
        lines.iter().filter(|l| l["event"] == "resume").collect();
    eprintln!("killed at step {killed_at}; resumes: {resumes:?}");
    assert!(!resumes.is_empty(), "no resume in metrics.jsonl");
    for r in &resumes {
        assert_eq!(r["source"], "STATE_SOURCE_MEMORY", "{resumes:?}");
        assert!(
            r["step"].as_u64().unwrap_or(0) + 1 >= killed_at,
            "resumed at {} after the kill at step {killed_at}: {resumes:?}",
            r["step"]
        );
    }
    // The stranger was still there, and still being evicted and re-opening.
    let after = state();
    eprintln!("attack at the end: {after}");
    assert!(
        on_ring.opened.load(Ordering::Relaxed) > HELD,
        "the ring port was not held: {after}"
    );
    runtime.shutdown_background();
}
