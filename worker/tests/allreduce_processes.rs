//! The ring between real `keel-worker` processes on 127.0.0.1: the benchmark end to end (it
//! checks its sums itself), and a peer process killed in the middle of an all-reduce.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_keel-worker");

#[test]
fn bench_allreduce_prints_one_json_line_per_world_and_size() {
    bench_allreduce_in("fp32");
}

/// The benchmark's peers check their sums themselves (exact in bf16 too: small integers).
#[test]
fn bench_allreduce_with_bf16_on_the_wire_checks_its_sums() {
    bench_allreduce_in("bf16");
}

fn bench_allreduce_in(dtype: &str) {
    let out = Command::new(EXE)
        .args(["bench-allreduce", "--workers", "2,3", "--sizes-mib", "1,2"])
        .args(["--iters", "2", "--timeout-secs", "60", "--dtype", dtype])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    for (line, (workers, mib)) in lines.iter().zip([(2, 1), (2, 2), (3, 1), (3, 2)]) {
        assert_eq!(line["workers"], workers);
        assert_eq!(line["threads"], 1, "the worker's default network runtime");
        assert_eq!(line["dtype"], dtype);
        assert_eq!(line["bytes"], mib << 20);
        assert!(line["seconds"].as_f64().unwrap() > 0.0);
        assert!(line["busbw_gb_s"].as_f64().unwrap() >= 0.0);
    }
}

#[test]
fn killing_a_peer_process_mid_all_reduce_fails_its_neighbours_naming_it() {
    let timeout_secs = 3;
    let mut peers: Vec<_> = (0..3)
        .map(|rank| {
            Command::new(EXE)
                .arg("allreduce-peer")
                .args(["--rank", &rank.to_string(), "--world", "3"])
                // Large and many, so the kill lands inside an all-reduce.
                .args(["--sizes-mib", "256", "--iters", "1000", "--warmup", "0"])
                .args([
                    "--streams-per-link",
                    "2",
                    "--frame-kib",
                    "256",
                    "--threads",
                    "1",
                ])
                .args(["--timeout-secs", &timeout_secs.to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let addrs: Vec<String> = peers
        .iter_mut()
        .map(|p| {
            let mut line = String::new();
            BufReader::new(p.stdout.as_mut().unwrap())
                .read_line(&mut line)
                .unwrap();
            line.trim().strip_prefix("LISTEN ").unwrap().to_string()
        })
        .collect();
    for p in &mut peers {
        let stdin = p.stdin.as_mut().unwrap();
        writeln!(stdin, "PEERS {}", addrs.join(",")).unwrap();
        stdin.flush().unwrap();
    }
    std::thread::sleep(Duration::from_millis(1500));
    peers[2].kill().unwrap();
    peers[2].wait().unwrap();
    // Ranks 0 and 1 must end by themselves (bounded wait: no hang), with an error.
    let deadline = Instant::now() + Duration::from_secs(10 * timeout_secs);
    let mut stderrs = Vec::new();
    for (rank, p) in peers.iter_mut().take(2).enumerate() {
        let status = loop {
            if let Some(status) = p.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                p.kill().unwrap();
                panic!("rank {rank} did not stop after its neighbour died");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(!status.success(), "rank {rank} must fail");
        let mut err = String::new();
        p.stderr.as_mut().unwrap().read_to_string(&mut err).unwrap();
        stderrs.push(err);
    }
    // Rank 0 waits on rank 2 (its left) and rank 1 sends to it: at least one names it, and
    // rank 0 always does.
    assert!(
        stderrs[0].contains("rank 2") && stderrs[0].contains(&addrs[2]),
        "rank 0 said: {}",
        stderrs[0]
    );
}
