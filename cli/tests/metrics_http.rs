//! The HTTP ports (`--metrics-listen`): a real coordinator and two real workers run a
//! short job; then the coordinator's and each worker's `/metrics` are scraped and checked
//! against `keel status` and the job's `metrics.jsonl`, the dashboard API against the same, and
//! the served metric names against `deploy/grafana/metric-names.txt` (what the Grafana
//! dashboard is checked against).
//!
//! The coordinator's port is bound to 0.0.0.0 (not loopback), so its API needs the cluster
//! token; the workers' ports are on 127.0.0.1.

mod common;

use common::http_get as get;
use common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// The samples of a metrics page: `name{labels}` -> value.
fn samples(page: &str) -> BTreeMap<String, f64> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (key, value) = l.rsplit_once(' ').unwrap();
            (key.to_string(), value.parse().unwrap())
        })
        .collect()
}

/// The metric name of a sample key (`keel_jobs{state="running"}` -> `keel_jobs`).
fn name_of(key: &str) -> &str {
    key.split('{').next().unwrap()
}

/// The one sample whose key starts with `prefix`.
fn one(samples: &BTreeMap<String, f64>, prefix: &str) -> f64 {
    let found: Vec<_> = samples
        .iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .collect();
    assert_eq!(found.len(), 1, "{prefix}: {found:?}");
    *found[0].1
}

fn close(a: f64, b: f64, what: &str) {
    assert!(
        (a - b).abs() <= 1e-9 * b.abs().max(1.0),
        "{what}: {a} against {b}"
    );
}

#[test]
fn metrics_and_the_dashboard_api_agree_with_status_and_the_step_log() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let coordinator_port = free_port();
    let (_coordinator, addr) = start_coordinator_with(
        root,
        &[
            "--metrics-listen".into(),
            format!("0.0.0.0:{coordinator_port}"),
        ],
    );
    let worker_ports = [free_port(), free_port()];
    let _workers: Vec<_> = worker_ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            start_worker_with(
                root,
                &addr,
                i,
                &["--metrics-listen".into(), format!("127.0.0.1:{port}")],
            )
        })
        .collect();
    let mut job = JobFile::new(kjv_lines(root, 2000));
    job.vocab_size = 500;
    job.max_steps = 24;
    job.eval_every = 8;
    job.checkpoint_every = 0;
    let job_path = job.write(root);
    let out = run_keel(
        &["submit", job_path.to_str().unwrap(), "--coordinator", &addr],
        root,
    );
    let job_id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let status = poll(Duration::from_secs(240), || {
        let s = status(&job_id, &addr, root);
        (s["state"] == "completed").then_some(s)
    })
    .unwrap_or_else(|| panic!("the job did not complete: {}", status(&job_id, &addr, root)));
    let lines = metrics(&root.join(format!("coordinator/jobs/{job_id}/metrics.jsonl")));
    let steps: Vec<_> = lines.iter().filter(|l| l.get("tokens").is_some()).collect();
    let evals: Vec<_> = lines
        .iter()
        .filter(|l| l.get("eval_loss").is_some())
        .collect();
    assert_eq!(steps.len(), 24);

    // The coordinator's page: no token needed, values as `keel status` and the log say.
    let (code, page) = get(coordinator_port, "/metrics", None);
    assert_eq!(code, 200, "{page}");
    let c = samples(&page);
    let job_label = format!("{{job_id=\"{job_id}\"}}");
    assert_eq!(c["keel_jobs{state=\"completed\"}"], 1.0);
    assert_eq!(c["keel_jobs{state=\"running\"}"], 0.0);
    assert_eq!(c["keel_workers_registered"], 2.0);
    assert_eq!(c["keel_workers_alive"], 2.0);
    let job_value = |name: &str| c[&format!("{name}{job_label}")];
    assert_eq!(job_value("keel_job_step"), status["step"].as_f64().unwrap());
    assert_eq!(job_value("keel_job_max_steps"), 24.0);
    assert_eq!(
        job_value("keel_job_generation"),
        status["generation"].as_f64().unwrap()
    );
    assert_eq!(job_value("keel_job_recoveries_total"), 0.0);
    assert_eq!(job_value("keel_job_skipped_steps_total"), 0.0);
    let last_step = steps.last().unwrap();
    close(
        job_value("keel_job_loss"),
        last_step["loss"].as_f64().unwrap(),
        "loss",
    );
    close(
        job_value("keel_job_learning_rate"),
        last_step["lr"].as_f64().unwrap(),
        "learning rate",
    );
    close(
        job_value("keel_job_eval_loss"),
        evals.last().unwrap()["eval_loss"].as_f64().unwrap(),
        "held-out loss",
    );
    assert!(
        page.contains(&format!(
            "keel_job_info{{job_id=\"{job_id}\",state=\"completed\",precision=\""
        )),
        "{page}"
    );

    // The API needs the token (the port is not on loopback); with it, it agrees.
    let token = std::fs::read_to_string(token_file()).unwrap();
    let token = token.trim();
    let (code, body) = get(coordinator_port, "/api/jobs", None);
    assert_eq!(code, 401, "{body}");
    let (code, _) = get(coordinator_port, "/api/jobs", Some("not-the-token"));
    assert_eq!(code, 401);
    let (code, body) = get(coordinator_port, "/api/jobs", Some(token));
    assert_eq!(code, 200, "{body}");
    let jobs: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(jobs["jobs"][0]["job_id"], job_id.as_str());
    assert_eq!(jobs["jobs"][0]["state"], "completed");
    assert_eq!(jobs["jobs"][0]["step"], status["step"]);
    let (code, body) = get(
        coordinator_port,
        &format!("/api/jobs/{job_id}/metrics?from=0"),
        Some(token),
    );
    assert_eq!(code, 200, "{body}");
    let api_lines: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(api_lines["lines"].as_array().unwrap().len(), lines.len());
    let next = api_lines["next"].as_u64().unwrap();
    let (_, body) = get(
        coordinator_port,
        &format!("/api/jobs/{job_id}/metrics?from={next}"),
        Some(token),
    );
    let rest: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(rest["lines"].as_array().unwrap().len(), 0, "{body}");
    let (code, _) = get(coordinator_port, "/api/jobs/job-99/metrics", Some(token));
    assert_eq!(code, 404);
    // Heartbeats carry each worker's last step times (they come within a heartbeat or two).
    let workers = poll(Duration::from_secs(15), || {
        let (_, body) = get(coordinator_port, "/api/workers", Some(token));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let all = v["workers"].as_array()?.clone();
        (all.len() == 2 && all.iter().all(|w| w["step_seconds"].as_f64().is_some())).then_some(all)
    })
    .expect("both workers' step times in /api/workers");
    for w in &workers {
        // The step as last heartbeated: the job may have ended between two heartbeats. A
        // worker that has gone idle since reports no job, its last step times, and step 0 or
        // the last step it held (both seen on a 2-core Zen 4 EPYC: `"state":"idle","step":0`
        // in CI, `"step":24` in a rerun).
        let step = w["step"].as_u64().unwrap();
        if w["job"].is_null() {
            assert_eq!(w["state"], "idle", "{w}");
            assert!(step <= 24, "{w}");
        } else {
            assert!((1..=24).contains(&step), "{w}");
        }
        assert!(w["ring_wait_seconds"].as_f64().unwrap() >= 0.0, "{w}");
    }

    // Each worker's page: its steps, the split of its step time, the ring's bytes.
    let logged_seconds: f64 = steps
        .iter()
        .map(|s| s["step_seconds"].as_f64().unwrap())
        .sum();
    let mut ranks = BTreeSet::new();
    let mut served: BTreeSet<String> = c.keys().map(|k| name_of(k).to_string()).collect();
    for port in worker_ports {
        let (code, page) = get(port, "/metrics", None);
        assert_eq!(code, 200, "{page}");
        let w = samples(&page);
        served.extend(w.keys().map(|k| name_of(k).to_string()));
        assert_eq!(w["keel_worker_steps_total"], 24.0, "{page}");
        assert_eq!(w["keel_worker_step"], 24.0, "{page}");
        let info: Vec<_> = w
            .keys()
            .filter(|k| k.starts_with(&format!("keel_worker_job_info{{job_id=\"{job_id}\"")))
            .collect();
        assert_eq!(info.len(), 1, "{page}");
        ranks.insert(info[0].clone());
        let phases: f64 = ["compute", "ring_wait", "optimizer", "other"]
            .iter()
            .map(|p| w[&format!("keel_worker_step_seconds_total{{phase=\"{p}\"}}")])
            .sum();
        // Each rank times its own steps; rank 0's are the log's. All ranks end each step
        // with the same all-reduce, so their sums agree within a few milliseconds a step.
        assert!(
            (phases - logged_seconds).abs() <= 0.1 * logged_seconds + 0.02 * 24.0,
            "phases sum to {phases} s, the log's steps to {logged_seconds} s\n{page}"
        );
        let gemm = w["keel_worker_gemm_seconds_total"];
        assert!(gemm > 0.0 && gemm < phases, "GEMM {gemm} s of {phases} s");
        assert!(w["keel_worker_allreduce_bytes_total"] > 1e5, "{page}");
        assert!(w["keel_worker_allreduce_seconds_total"] > 0.0, "{page}");
        assert!(w["keel_worker_resident_memory_bytes"] > 1e7, "{page}");
        assert!(w["keel_worker_shard_cache_bytes"] > 0.0, "{page}");
        assert!(w["keel_worker_last_step_duration_seconds"] > 0.0, "{page}");
        assert!(one(&w, "keel_worker_last_step_seconds{phase=\"compute\"}") > 0.0);
    }
    assert_eq!(ranks.len(), 2, "two ranks: {ranks:?}");

    // Exactly the names the Grafana dashboard and deploy checks know.
    let listed = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/metric-names.txt"),
    )
    .unwrap();
    let listed: BTreeSet<String> = listed
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    assert_eq!(served, listed, "served names against metric-names.txt");
}
