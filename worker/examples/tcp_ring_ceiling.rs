//! The transport's ceiling for `keel-worker bench-allreduce`: the same ring all-reduce
//! (reduce-scatter then all-gather, pipelined frame by frame, f32 sums) between N local
//! processes, but over bare TCP sockets on 127.0.0.1 with no HTTP/2, no gRPC, no acks, no
//! async runtime and no checks. Any ring over gRPC on loopback does this work and more, so
//! its bus bandwidth bounds what Keel's gRPC ring can reach on this machine.
//!
//! Not part of Keel; a measuring tool. Prints one JSON line per (world size, size) in the
//! bench's format: bus bandwidth = 2 (n - 1) / n x bytes / seconds, the median over the timed
//! iterations of the slowest rank.
//!
//! Usage: `cargo run --release -p keel-worker --example tcp_ring_ceiling -- [--workers 2,3,4]
//! [--sizes-mib 4,16,64,256] [--iters 5] [--frame-kib 512]`

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Command line of the parent (and, with `--rank`, of a child).
struct Args {
    workers: Vec<usize>,
    sizes_mib: Vec<usize>,
    iters: usize,
    warmup: usize,
    frame_bytes: usize,
    /// Set in a child: its rank, the world size and the first port of the ring.
    child: Option<(usize, usize, u16)>,
}

fn parse_list(s: &str) -> Vec<usize> {
    s.split(',').filter_map(|x| x.trim().parse().ok()).collect()
}

fn parse_args() -> Args {
    let mut a = Args {
        workers: vec![2, 3, 4],
        sizes_mib: vec![4, 16, 64, 256],
        iters: 5,
        warmup: 1,
        frame_bytes: 512 << 10,
        child: None,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut rank = None;
    let mut world = 0;
    let mut port = 0;
    for pair in argv.chunks(2) {
        let value = pair.get(1).map(String::as_str).unwrap_or("");
        match pair[0].as_str() {
            "--workers" => a.workers = parse_list(value),
            "--sizes-mib" => a.sizes_mib = parse_list(value),
            "--iters" => a.iters = value.parse().unwrap_or(5),
            "--warmup" => a.warmup = value.parse().unwrap_or(1),
            "--frame-kib" => a.frame_bytes = value.parse::<usize>().unwrap_or(512) << 10,
            "--rank" => rank = value.parse().ok(),
            "--world" => world = value.parse().unwrap_or(0),
            "--port" => port = value.parse().unwrap_or(0),
            other => {
                eprintln!("unknown option {other}");
                std::process::exit(2);
            }
        }
    }
    a.child = rank.map(|r| (r, world, port));
    a
}

fn main() {
    let args = parse_args();
    match args.child {
        Some((rank, world, port)) => child(&args, rank, world, port),
        None => parent(&args),
    }
}

/// Starts `world` children per world size and prints rank 0's JSON lines. A child that fails
/// (a port taken after all, a broken connection) fails the run: the others are killed rather
/// than left waiting for it.
fn parent(args: &Args) {
    let exe = std::env::current_exe().expect("own path");
    for &world in &args.workers {
        let port = free_ports(world).unwrap_or_else(|| {
            eprintln!("no {world} consecutive free ports on 127.0.0.1 found");
            std::process::exit(1);
        });
        let mut children: Vec<_> = (0..world)
            .map(|rank| {
                Command::new(&exe)
                    .args([
                        "--rank",
                        &rank.to_string(),
                        "--world",
                        &world.to_string(),
                        "--port",
                        &port.to_string(),
                        "--sizes-mib",
                        &join(&args.sizes_mib),
                        "--iters",
                        &args.iters.to_string(),
                        "--warmup",
                        &args.warmup.to_string(),
                        "--frame-kib",
                        &(args.frame_bytes >> 10).to_string(),
                    ])
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("spawn a ring process")
            })
            .collect();
        let out = children[0].stdout.take().expect("rank 0's stdout");
        let printer = std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                println!("{line}");
            }
        });
        let mut running = world;
        while running > 0 {
            running = 0;
            for (rank, c) in children.iter_mut().enumerate() {
                match c.try_wait() {
                    Ok(None) => running += 1,
                    Ok(Some(status)) if status.success() => {}
                    Ok(Some(status)) => {
                        eprintln!("ring process rank {rank} of {world} failed ({status})");
                        for other in children.iter_mut() {
                            let _ = other.kill();
                            let _ = other.wait();
                        }
                        std::process::exit(1);
                    }
                    Err(e) => panic!("waiting for rank {rank}: {e}"),
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = printer.join();
    }
}

/// A first port `p` such that `p .. p + n` can all be bound on 127.0.0.1 now (tried from a
/// start that differs by process, so that runs side by side seldom collide).
fn free_ports(n: usize) -> Option<u16> {
    let start = 20000 + (std::process::id() % 2000) as u16 * 16;
    (0..200u16)
        .map(|k| start.wrapping_add(k * 64) % 40000 + 20000)
        .find(|&base| {
            let held: Vec<_> = (0..n as u16)
                .map_while(|r| TcpListener::bind(("127.0.0.1", base + r)).ok())
                .collect();
            held.len() == n
        })
}

fn join(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// Frames finished per global ring step, for the sender to follow the receiver.
struct Progress {
    done: Mutex<Vec<usize>>,
    changed: Condvar,
}

/// The buffer shared by the sender and receiver threads of one process. They touch disjoint
/// chunks at any time except where the sender waits, through `Progress`, for a frame the
/// receiver finished (that wait orders the accesses).
#[derive(Clone, Copy)]
struct Shared(*mut f32);
unsafe impl Send for Shared {}

fn chunk(len: usize, n: usize, c: usize) -> (usize, usize) {
    (len * c / n, len * (c + 1) / n)
}

/// One all-reduce (sum) of `buf` over the ring.
fn all_reduce(
    buf: &mut [f32],
    rank: usize,
    n: usize,
    right: &mut TcpStream,
    left: &mut TcpStream,
    frame_elems: usize,
) {
    let steps = 2 * (n - 1);
    let len = buf.len();
    // Ring step g sends chunk send(g) and receives chunk send(g + 1).
    let send_chunk = |g: usize| {
        if g < n - 1 {
            (rank + n - g % n) % n
        } else {
            (rank + 1 + n - (g - (n - 1)) % n) % n
        }
    };
    let progress = Arc::new(Progress {
        done: Mutex::new(vec![0; steps]),
        changed: Condvar::new(),
    });
    let ptr = Shared(buf.as_mut_ptr());
    std::thread::scope(|s| {
        let p = Arc::clone(&progress);
        let right = &mut *right;
        s.spawn(move || {
            let ptr = ptr;
            for g in 0..steps {
                let (lo, hi) = chunk(len, n, send_chunk(g));
                let mut at = lo;
                let mut k = 0;
                while at < hi {
                    let end = (at + frame_elems).min(hi);
                    if g > 0 {
                        let mut done = p.done.lock().expect("progress lock");
                        while done[g - 1] <= k {
                            done = p.changed.wait(done).expect("progress lock");
                        }
                    }
                    // SAFETY: [at, end) lies in the buffer; the receiver finished it (above) and
                    // does not write it again during this all-reduce's later steps until the
                    // sender has sent it (the ring's data dependence).
                    let bytes = unsafe {
                        std::slice::from_raw_parts(ptr.0.add(at) as *const u8, (end - at) * 4)
                    };
                    right.write_all(bytes).expect("send a frame");
                    at = end;
                    k += 1;
                }
            }
        });
        let mut scratch = vec![0f32; frame_elems];
        for g in 0..steps {
            let (lo, hi) = chunk(len, n, send_chunk(g + 1));
            let mut at = lo;
            while at < hi {
                let end = (at + frame_elems).min(hi);
                if g < n - 1 {
                    let tmp = &mut scratch[..end - at];
                    // SAFETY: an f32 slice viewed as bytes.
                    let bytes = unsafe {
                        std::slice::from_raw_parts_mut(tmp.as_mut_ptr() as *mut u8, tmp.len() * 4)
                    };
                    left.read_exact(bytes).expect("receive a frame");
                    // SAFETY: [at, end) is this step's receive chunk, not read by the sender now.
                    let dst = unsafe { std::slice::from_raw_parts_mut(ptr.0.add(at), end - at) };
                    for (d, x) in dst.iter_mut().zip(tmp.iter()) {
                        *d += *x;
                    }
                } else {
                    // SAFETY: as above; the all-gather writes the finished sums in place.
                    let bytes = unsafe {
                        std::slice::from_raw_parts_mut(ptr.0.add(at) as *mut u8, (end - at) * 4)
                    };
                    left.read_exact(bytes).expect("receive a frame");
                }
                at = end;
                let mut done = progress.done.lock().expect("progress lock");
                done[g] += 1;
                progress.changed.notify_one();
            }
        }
    });
}

fn child(args: &Args, rank: usize, n: usize, port: u16) {
    let listener = TcpListener::bind(("127.0.0.1", port + rank as u16)).expect("bind");
    let right_port = port + ((rank + 1) % n) as u16;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut right = loop {
        match TcpStream::connect(("127.0.0.1", right_port)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("connect to the right neighbour: {e}"),
        }
    };
    let (mut left, _) = listener.accept().expect("accept the left neighbour");
    right.set_nodelay(true).expect("nodelay");
    left.set_nodelay(true).expect("nodelay");
    let frame_elems = args.frame_bytes / 4;
    for &mib in &args.sizes_mib {
        let mut buf = vec![1f32; mib * (1 << 20) / 4];
        let mut times = Vec::new();
        let mut cpu = Vec::new();
        for it in 0..args.warmup + args.iters {
            let mut token = vec![0f32; n];
            all_reduce(&mut token, rank, n, &mut right, &mut left, frame_elems);
            let cpu0 = process_cpu_seconds();
            let t0 = Instant::now();
            all_reduce(&mut buf, rank, n, &mut right, &mut left, frame_elems);
            let dt = t0.elapsed().as_secs_f64();
            if it >= args.warmup {
                times.push(dt);
                cpu.push(process_cpu_seconds() - cpu0);
            }
        }
        // Slowest rank per iteration: an all-reduce of the times with max, done as a sum of
        // one-hot rows.
        let mut table = vec![0f32; n * times.len()];
        for (i, t) in times.iter().enumerate() {
            table[rank * times.len() + i] = *t as f32;
        }
        all_reduce(&mut table, rank, n, &mut right, &mut left, frame_elems);
        // CPU seconds of the timed all-reduces, summed over the ranks (as bench-allreduce).
        let mut cpu_sum = vec![cpu.iter().sum::<f64>() as f32];
        all_reduce(&mut cpu_sum, rank, n, &mut right, &mut left, frame_elems);
        if rank == 0 {
            let mut slowest: Vec<f64> = (0..times.len())
                .map(|i| {
                    (0..n)
                        .map(|r| table[r * times.len() + i] as f64)
                        .fold(0.0, f64::max)
                })
                .collect();
            slowest.sort_by(f64::total_cmp);
            let s = slowest[slowest.len() / 2];
            let b = (mib << 20) as f64;
            // The sums are checked too: k all-reduces of ones leave n^k everywhere.
            let want = (n as f32).powi((args.warmup + args.iters) as i32);
            let ok = buf.iter().all(|&x| x == want);
            println!(
                "{{\"peer\":\"tcp-ring\",\"workers\":{n},\"bytes\":{},\"iters\":{},\"seconds\":{s:.6},\"busbw_gb_s\":{:.3},\"cpu_seconds_all_ranks\":{:.4},\"sums_exact\":{ok}}}",
                mib << 20,
                times.len(),
                2.0 * (n as f64 - 1.0) / n as f64 * b / s / 1e9,
                cpu_sum[0] as f64 / times.len() as f64
            );
            let _ = std::io::stdout().flush();
        }
    }
}

/// User + system CPU time of this process (all threads), seconds.
fn process_cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct we pass; an all-zero rusage is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer cannot fail.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}
