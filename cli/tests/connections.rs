//! Strangers holding connections (abuse case 5, `scripts/abuse.sh`): a real coordinator on
//! 127.0.0.1 closes connections that never finish the HTTP/2 preface or go silent, evicts the
//! oldest unauthenticated connections when full (so that `keel` with the token gets in), and
//! neither spins nor stays stuck when it runs out of file descriptors. The limits are set
//! through their variables (KEEL_MAX_CONNECTIONS, KEEL_HANDSHAKE_TIMEOUT, KEEL_AUTH_TIMEOUT,
//! KEEL_IDLE_TIMEOUT), small so that the tests are quick.

mod common;

use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// The HTTP/2 client preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A coordinator on a free port with `env` set and, when given, its open-file limit lowered
/// to `nofile` before it starts.
fn coordinator(root: &Path, env: &[(&str, &str)], nofile: Option<u64>) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let log = logs.join("coordinator.log");
    let file = std::fs::File::create(&log).unwrap();
    let mut c = command(&sibling("keel-coordinator"));
    c.args(["--listen", &addr, "--data-dir"])
        .arg(root.join("coordinator"))
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file);
    if let Some(n) = nofile {
        let limit = libc::rlimit {
            rlim_cur: n,
            rlim_max: n,
        };
        // SAFETY: setrlimit is async-signal-safe; the closure touches nothing else.
        unsafe {
            c.pre_exec(move || {
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let p = Proc {
        name: "coordinator".into(),
        child: c.spawn().unwrap(),
        log,
    };
    wait_listening(&addr, &p);
    (p, addr)
}

/// A worker of the coordinator at `coordinator` listening on a free port with `env` set;
/// returns it and its address.
fn worker(root: &Path, coordinator: &str, env: &[(&str, &str)]) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let log = root.join("logs").join("worker.log");
    let file = std::fs::File::create(&log).unwrap();
    let child = command(&sibling("keel-worker"))
        .args([
            "--coordinator",
            coordinator,
            "--listen",
            &addr,
            "--advertise-addr",
            &addr,
        ])
        .args(["--threads", "1", "--cache-dir"])
        .arg(root.join("worker"))
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .spawn()
        .unwrap();
    let p = Proc {
        name: "worker".into(),
        child,
        log,
    };
    wait_listening(&addr, &p);
    (p, addr)
}

/// Polls `keel jobs` until it succeeds (at most `limit`).
fn keel_jobs_works(addr: &str, cwd: &Path, limit: Duration) -> bool {
    poll(limit, || {
        keel_jobs(addr, cwd).status.success().then_some(())
    })
    .is_some()
}

/// Whether the server closed `s` (EOF or reset) within `limit`.
fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).unwrap();
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            // The server's SETTINGS frame, after a full preface: read on.
            Ok(_) if Instant::now() < deadline => continue,
            Ok(_) => return false,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false;
            }
            Err(_) => return true,
        }
    }
}

/// CPU time (user + system) of process `pid` so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) in parentheses.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Duration::from_secs_f64(ticks as f64 / per_second)
}

#[test]
fn partial_prefaces_and_silent_connections_are_closed_after_their_timeouts() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (_coordinator, addr) = coordinator(
        root,
        &[("KEEL_HANDSHAKE_TIMEOUT", "1"), ("KEEL_IDLE_TIMEOUT", "3")],
        None,
    );
    let started = Instant::now();
    // Nothing sent, part of the preface sent.
    let mut strangers: Vec<TcpStream> = (0..40)
        .map(|i| {
            let mut s = TcpStream::connect(&addr).unwrap();
            if i % 2 == 1 {
                s.write_all(&PREFACE[..10]).unwrap();
            }
            s
        })
        .collect();
    for s in &mut strangers {
        assert!(
            closed_within(s, Duration::from_secs(10)),
            "a connection without the full preface stayed open {:?}",
            started.elapsed()
        );
    }
    // A full preface, then silence (no SETTINGS, no answer to anything): closed after the
    // idle timeout, not before the handshake one.
    let mut quiet = TcpStream::connect(&addr).unwrap();
    quiet.write_all(PREFACE).unwrap();
    let started = Instant::now();
    assert!(
        closed_within(&mut quiet, Duration::from_secs(15)),
        "a silent connection stayed open"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );
    // The server still serves.
    assert!(keel_jobs_works(&addr, root, Duration::from_secs(30)));
}

#[test]
fn a_full_server_evicts_the_oldest_unauthenticated_connections_and_keel_gets_in() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (coordinator, addr) = coordinator(
        root,
        &[
            ("KEEL_MAX_CONNECTIONS", "20"),
            ("KEEL_HANDSHAKE_TIMEOUT", "120"),
            ("KEEL_AUTH_TIMEOUT", "120"),
        ],
        None,
    );
    assert!(keel_jobs_works(&addr, root, Duration::from_secs(30)));
    // The probe connections of the calls above are closed by now (they ended): give the
    // server a moment to see it.
    std::thread::sleep(Duration::from_millis(500));
    let mut held: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(PREFACE).unwrap();
            // One at a time, so that the server sees them in this order.
            std::thread::sleep(Duration::from_millis(20));
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    // Five more: each evicts the oldest held one (they all come from 127.0.0.1).
    let newer: Vec<TcpStream> = (0..5)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(PREFACE).unwrap();
            s
        })
        .collect();
    for (i, s) in held.iter_mut().enumerate().take(5) {
        assert!(
            closed_within(s, Duration::from_secs(5)),
            "held connection {i} was not evicted"
        );
    }
    for (i, s) in held.iter_mut().enumerate().skip(5).take(3) {
        assert!(
            !closed_within(s, Duration::from_millis(200)),
            "held connection {i} was evicted before older ones"
        );
    }
    // `keel` proves itself with the token: it gets in while strangers fill the server.
    let full = keel_jobs(&addr, root);
    assert!(
        full.status.success(),
        "keel jobs was locked out: {}\n{}",
        String::from_utf8_lossy(&full.stderr),
        coordinator.log_text()
    );
    let log = coordinator.log_text();
    assert!(log.contains("evicted the oldest connection"), "{log}");
    // One line per 10 s, not one per eviction.
    assert_eq!(
        log.matches("evicted the oldest connection").count(),
        1,
        "{log}"
    );
    assert!(!log.contains("connection refused"), "{log}");
    drop((held, newer));
    assert!(
        keel_jobs_works(&addr, root, Duration::from_secs(30)),
        "keel jobs failed after the held connections closed:\n{}",
        coordinator.log_text()
    );
}

#[test]
fn out_of_file_descriptors_the_coordinator_does_not_spin_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (coordinator, addr) = coordinator(
        root,
        &[
            ("KEEL_MAX_CONNECTIONS", "1000"),
            ("KEEL_HANDSHAKE_TIMEOUT", "120"),
            ("KEEL_IDLE_TIMEOUT", "120"),
        ],
        Some(64),
    );
    assert!(keel_jobs_works(&addr, root, Duration::from_secs(30)));
    // More connections than the coordinator has descriptors: the rest wait in the backlog.
    let held: Vec<TcpStream> = (0..100)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(PREFACE).unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let pid = coordinator.child.id();
    let before = (Instant::now(), cpu_time(pid));
    std::thread::sleep(Duration::from_secs(3));
    let used = cpu_time(pid) - before.1;
    let share = used.as_secs_f64() / before.0.elapsed().as_secs_f64();
    assert!(
        share < 0.2,
        "the coordinator used {:.0}% of a core at its open-file limit",
        share * 100.0
    );
    let log = coordinator.log_text();
    assert!(log.contains("cannot accept connections"), "{log}");
    assert!(
        log.matches("cannot accept connections").count() <= 2,
        "accept errors are logged at most once per 10 s:\n{log}"
    );
    drop(held);
    assert!(
        keel_jobs_works(&addr, root, Duration::from_secs(30)),
        "keel jobs failed after descriptors were freed:\n{}",
        coordinator.log_text()
    );
}

#[test]
fn a_workers_ring_port_closes_partial_prefaces_too() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let (_coordinator, addr) = coordinator(root, &[], None);
    let (_worker, ring) = worker(root, &addr, &[("KEEL_HANDSHAKE_TIMEOUT", "1")]);
    let mut stranger = TcpStream::connect(&ring).unwrap();
    stranger.write_all(&PREFACE[..10]).unwrap();
    assert!(
        closed_within(&mut stranger, Duration::from_secs(10)),
        "the worker kept a connection without the full preface"
    );
}
