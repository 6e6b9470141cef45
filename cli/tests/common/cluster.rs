//! A coordinator and its workers as real processes on 127.0.0.1, for tests that submit several
//! jobs, kill workers and restart the coordinator.

use super::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A coordinator and its workers.
pub struct Cluster {
    dir: tempfile::TempDir,
    pub coordinator: Proc,
    pub addr: String,
    pub workers: Vec<Proc>,
    started: usize,
}

impl Cluster {
    pub fn new(workers: usize) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let (coordinator, addr) = start_coordinator(dir.path());
        let mut c = Cluster {
            dir,
            coordinator,
            addr,
            workers: Vec::new(),
            started: 0,
        };
        for _ in 0..workers {
            c.add_worker();
        }
        c
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// Starts a worker and waits until it has registered (a job submitted earlier would
    /// start on fewer workers and sum in another order).
    pub fn add_worker(&mut self) {
        let (w, _) = start_worker(self.root(), &self.addr, self.started);
        self.started += 1;
        let registered = poll(Duration::from_secs(120), || {
            w.log_text().contains("registered").then_some(())
        });
        assert!(registered.is_some(), "no registration:\n{}", w.log_text());
        self.workers.push(w);
    }

    /// Submits `job` with `extra` appended to its file (e.g. `[[phase]]` sections) from a
    /// folder `name`; returns the job id.
    pub fn submit_job(&self, name: &str, job: &JobFile, extra: &str) -> String {
        self.submit_edited(name, job, |text| text + extra)
    }

    /// Submits `job` with its file's text passed through `edit`; returns the job id.
    pub fn submit_edited(
        &self,
        name: &str,
        job: &JobFile,
        edit: impl FnOnce(String) -> String,
    ) -> String {
        let case = self.root().join(name);
        std::fs::create_dir_all(&case).unwrap();
        let path = job.write(&case);
        let text = edit(std::fs::read_to_string(&path).unwrap());
        std::fs::write(&path, text).unwrap();
        let out = run_keel(
            &[
                "submit",
                path.to_str().unwrap(),
                "--coordinator",
                &self.addr,
            ],
            self.root(),
        );
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    /// Waits until `f(status)` holds (the job must not fail meanwhile).
    pub fn wait(&self, job: &str, what: &str, f: impl Fn(&serde_json::Value) -> bool) {
        let limit = Duration::from_secs(600);
        poll(limit, || {
            let s = status(job, &self.addr, self.root());
            assert_ne!(s["state"], "failed", "failed waiting for {what}: {s}");
            f(&s).then_some(())
        })
        .unwrap_or_else(|| panic!("{what}: not within {limit:?}"));
    }

    pub fn step_at_least(&self, job: &str, step: u64) {
        self.wait(job, &format!("step {step}"), |s| {
            assert_ne!(
                s["state"], "completed",
                "the job ended before step {step}: {s}"
            );
            s["step"].as_u64().unwrap_or(0) >= step
        });
    }

    pub fn completed(&self, job: &str) -> PathBuf {
        self.wait(job, "completion", |s| s["state"] == "completed");
        let out_dir = self.root().join(format!("{job}-checkpoint"));
        let args = ["pull", job, "--out", out_dir.to_str().unwrap()];
        let out = run_keel(
            &[&args[..], &["--coordinator", &self.addr]].concat(),
            self.root(),
        );
        assert!(out.status.success(), "{out:?}");
        out_dir
    }

    /// kill -9 of the coordinator, then a new one on the same address and folder.
    pub fn restart_coordinator(&mut self) {
        self.coordinator.child.kill().unwrap();
        self.coordinator.child.wait().unwrap();
        self.coordinator = Proc::spawn(
            "coordinator-2",
            &sibling("keel-coordinator"),
            &[
                "--listen".into(),
                self.addr.clone(),
                "--data-dir".into(),
                self.root().join("coordinator").display().to_string(),
            ],
            &self.root().join("logs"),
        );
        // A status call right after the spawn would race the bind (seen in CI: "Connection
        // refused" from the poll after a restart).
        wait_listening(&self.addr, &self.coordinator);
    }
}
