//! Helpers shared by the end-to-end tests: the built binaries, job files, real processes on
//! 127.0.0.1 that are killed when dropped. Every process started here gets the test cluster
//! token ([`token_file`]) through `KEEL_TOKEN_FILE`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The token file every process of the tests' clusters uses (mode 600), made once per test
/// binary in a temporary folder that is removed when the test binary exits.
pub fn token_file() -> &'static Path {
    static TOKEN: OnceLock<PathBuf> = OnceLock::new();
    TOKEN.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("keel-e2e-token-")
            .tempdir()
            .unwrap();
        // A `TempDir` in a static is never dropped (Rust runs no destructors of statics), which
        // left an empty keel-e2e-token-* folder in /tmp per test binary: remove it at exit.
        let dir = dir.keep();
        TOKEN_DIR.set(dir.clone()).unwrap();
        // SAFETY: `remove_token_dir` is an `extern "C" fn()` that neither unwinds nor
        // calls `exit`; registering it has no other precondition.
        let registered = unsafe { libc::atexit(remove_token_dir) };
        assert_eq!(registered, 0, "atexit failed");
        let path = dir.join("keel.token");
        keel_net::auth::ClusterToken::create_file(&path).unwrap();
        path
    })
}

/// The folder of [`token_file`], for [`remove_token_dir`].
static TOKEN_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Removes the token folder; run by the C library when the test binary exits (libtest ends
/// through `exit` both when all tests pass and when some fail).
extern "C" fn remove_token_dir() {
    if let Some(dir) = TOKEN_DIR.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A `Command` for `exe` with the test cluster token in its environment.
pub fn command(exe: &Path) -> Command {
    let mut c = Command::new(exe);
    c.env("KEEL_TOKEN_FILE", token_file());
    c
}

/// The `keel` binary under test.
pub fn keel() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keel"))
}

/// A sibling binary of `keel` (keel-coordinator, keel-worker), built by `cargo test --workspace`
/// or `cargo build --bins`.
pub fn sibling(name: &str) -> PathBuf {
    let path = keel().parent().unwrap().join(name);
    assert!(
        path.is_file(),
        "{} is missing: build the binaries first (cargo build --release --bins)",
        path.display()
    );
    path
}

pub mod cluster;
pub mod disk;

#[path = "../../../fixtures/testdata.rs"]
mod testdata;
#[allow(unused_imports)] // each test binary uses some of them
pub use testdata::{corpus, fixture};

/// A small job: tiny BERT, sequences of 64 tokens, a small vocabulary.
pub struct JobFile {
    pub corpus: PathBuf,
    pub vocab_size: usize,
    /// A vocabulary file instead of training one.
    pub vocab: Option<PathBuf>,
    pub micro_batch_size: usize,
    pub grad_accum: usize,
    pub max_steps: u64,
    pub workers: usize,
    pub learning_rate: f64,
    pub warmup_steps: u64,
    pub checkpoint_every: u64,
    pub eval_every: u64,
    pub peer_timeout_seconds: f64,
    pub objective: &'static str,
    pub lowercase: bool,
    /// Lines appended to `[cluster]` (e.g. `max_recoveries = 0`).
    pub cluster_extra: String,
    /// Lines appended to `[train]`.
    pub train_extra: String,
}

impl JobFile {
    pub fn new(corpus: PathBuf) -> Self {
        JobFile {
            corpus,
            vocab_size: 1000,
            vocab: None,
            micro_batch_size: 8,
            grad_accum: 1,
            max_steps: 200,
            workers: 2,
            learning_rate: 2e-3,
            warmup_steps: 20,
            checkpoint_every: 100,
            eval_every: 100,
            peer_timeout_seconds: 30.0,
            objective: "mlm",
            lowercase: true,
            cluster_extra: String::new(),
            train_extra: String::new(),
        }
    }

    /// Writes the job to `dir/job.toml`.
    pub fn write(&self, dir: &Path) -> PathBuf {
        let text = format!(
            r#"[data]
corpus = ["{corpus}"]
{vocab}
lowercase = {lower}
objective = "{objective}"
max_seq_length = 64
masked_lm_prob = 0.15
max_predictions_per_seq = 10
heldout_fraction = 0.01
[model]
preset = "tiny"
[train]
micro_batch_size = {mbs}
gradient_accumulation_steps = {ga}
max_steps = {steps}
optimizer = "adamw"
learning_rate = {lr}
warmup_steps = {warmup}
schedule = "linear"
weight_decay = 0.01
max_grad_norm = 1.0
seed = 42
checkpoint_every = {ckpt}
eval_every = {eval}
{train_extra}
[cluster]
min_workers = {w}
max_workers = {w}
peer_timeout_seconds = {timeout}
{cluster_extra}
"#,
            train_extra = self.train_extra,
            cluster_extra = self.cluster_extra,
            corpus = self.corpus.display(),
            vocab = match &self.vocab {
                Some(path) => format!("vocab = \"{}\"", path.display()),
                None => format!("vocab_size = {}", self.vocab_size),
            },
            lower = self.lowercase,
            objective = self.objective,
            mbs = self.micro_batch_size,
            ga = self.grad_accum,
            steps = self.max_steps,
            lr = self.learning_rate,
            warmup = self.warmup_steps,
            ckpt = self.checkpoint_every,
            eval = self.eval_every,
            w = self.workers,
            timeout = self.peer_timeout_seconds,
        );
        let path = dir.join("job.toml");
        std::fs::write(&path, text).unwrap();
        path
    }
}

/// Runs `keel ARGS` to completion (with a generous bound) and returns its output.
pub fn run_keel(args: &[&str], cwd: &Path) -> Output {
    let out = command(&keel())
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    if !out.status.success() {
        panic!(
            "keel {args:?} failed: {}\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// `keel local --workers N JOB --out OUT --work-dir WORK --threads 1 --quiet`.
pub fn keel_local(job: &Path, workers: usize, out: &Path, work: &Path) -> Output {
    run_keel(
        &[
            "local",
            "--workers",
            &workers.to_string(),
            job.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--work-dir",
            work.to_str().unwrap(),
            "--threads",
            "1",
            "--quiet",
        ],
        job.parent().unwrap(),
    )
}

/// A process that is killed and reaped when dropped.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn spawn(name: &str, exe: &Path, args: &[String], logs: &Path) -> Proc {
        let log = logs.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = command(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        Proc {
            name: name.to_string(),
            child,
            log,
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// One HTTP/1.1 GET to `127.0.0.1:port`; returns the status code and the body.
pub fn http_get(port: u16, path: &str, token: Option<&str>) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{auth}\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").expect("an HTTP reply");
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "this reader expects a Content-Length body: {head}"
    );
    let code = head.split(' ').nth(1).unwrap().parse().unwrap();
    (code, body.to_string())
}

/// A free port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A coordinator process on a free port; returns it and its address.
pub fn start_coordinator(root: &Path) -> (Proc, String) {
    start_coordinator_with(root, &[])
}

/// A coordinator process on a free port with `extra` flags (TLS); returns it and its address.
pub fn start_coordinator_with(root: &Path, extra: &[String]) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let p = Proc::spawn(
        "coordinator",
        &sibling("keel-coordinator"),
        &[
            "--listen".to_string(),
            addr.clone(),
            "--data-dir".into(),
            root.join("coordinator").display().to_string(),
        ]
        .iter()
        .cloned()
        .chain(extra.iter().cloned())
        .collect::<Vec<String>>(),
        &logs,
    );
    wait_listening(&addr, &p);
    (p, addr)
}

/// Waits (at most 30 s) until `addr` accepts TCP connections: a `keel` call made right after
/// the spawn would otherwise race the coordinator's bind ("tcp connect error", seen in a full
/// `cargo test` run on a loaded machine).
pub fn wait_listening(addr: &str, process: &Proc) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(
            Instant::now() < deadline,
            "nothing listens on {addr} 30 s after the start; log:\n{}",
            process.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A worker process on a free port, 1 thread; returns it and its advertise address.
pub fn start_worker(root: &Path, coordinator: &str, i: usize) -> (Proc, String) {
    start_worker_with(root, coordinator, i, &[])
}

/// A worker process on a free port, 1 thread, with `extra` flags (TLS, another token file);
/// returns it and its advertise address.
pub fn start_worker_with(
    root: &Path,
    coordinator: &str,
    i: usize,
    extra: &[String],
) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let p = Proc::spawn(
        &format!("worker-{i}"),
        &sibling("keel-worker"),
        &[
            "--coordinator".to_string(),
            coordinator.into(),
            "--listen".into(),
            addr.clone(),
            "--advertise-addr".into(),
            addr.clone(),
            "--threads".into(),
            "1".into(),
            "--cache-dir".into(),
            root.join(format!("worker-{i}")).display().to_string(),
        ]
        .iter()
        .cloned()
        .chain(extra.iter().cloned())
        .collect::<Vec<String>>(),
        &root.join("logs"),
    );
    (p, addr)
}

/// `keel status JOB` as JSON.
pub fn status(job: &str, coordinator: &str, cwd: &Path) -> serde_json::Value {
    let out = run_keel(&["status", job, "--coordinator", coordinator], cwd);
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Polls `f` every 200 ms until it returns `Some`, at most `limit`.
pub fn poll<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(v) = f() {
            return Some(v);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    None
}

/// The JSON lines of a metrics.jsonl.
pub fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The first `lines` lines of the King James Bible, written to `dir/kjv-part.txt` (real text,
/// small enough to prepare fast).
pub fn kjv_lines(dir: &Path, lines: usize) -> PathBuf {
    let text = std::fs::read_to_string(corpus("en-kjv").join("kjv.txt")).unwrap();
    let part: Vec<&str> = text.lines().take(lines).collect();
    let path = dir.join("kjv-part.txt");
    std::fs::write(&path, part.join("\n") + "\n").unwrap();
    path
}

/// Asserts that checkpoint folder `got` holds the same `model.safetensors` and
/// `optimizer.safetensors` as `expected`, byte for byte (naming the weights' largest relative
/// difference when they differ).
pub fn assert_same_checkpoint(got: &Path, expected: &Path) {
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let same = std::fs::read(expected.join(f)).unwrap() == std::fs::read(got.join(f)).unwrap();
        assert!(
            same,
            "{f} differs from the uninterrupted run (max relative difference {:e})",
            max_relative_difference(got, expected)
        );
    }
}

/// Largest per-tensor `max |a - b| / max |b|` between two checkpoint folders' weights, over
/// every tensor but the attention key biases: their true gradient is exactly 0 (softmax is
/// invariant to adding the same number to every score of a query), so their gradient is pure
/// rounding noise and Adam's `m / sqrt(v)` turns any reordering of the sums into a full-size
/// step.
pub fn max_relative_difference(a: &Path, b: &Path) -> f64 {
    let load =
        |d: &Path| keel_proto::weights::load_tensors_f64(d.join("model.safetensors")).unwrap();
    let (wa, wb) = (load(a), load(b));
    assert_eq!(wa.keys().collect::<Vec<_>>(), wb.keys().collect::<Vec<_>>());
    let mut worst = 0f64;
    for (name, (shape, va)) in &wa {
        let (shape_b, vb) = &wb[name];
        assert_eq!(shape, shape_b, "{name}");
        if name.ends_with("attention.self.key.bias") {
            continue;
        }
        let scale = vb.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-12);
        let diff = va
            .iter()
            .zip(vb)
            .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
        worst = worst.max(diff / scale);
    }
    worst
}

/// `keel jobs` against `addr`, killed after 30 s (a hang is a failure, not a stuck test).
pub fn keel_jobs(addr: &str, cwd: &Path) -> Output {
    let mut child = command(&keel())
        .args(["jobs", "--coordinator", addr])
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}
