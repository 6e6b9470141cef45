//! Shared by the allreduce_* tests: ring peers as real tonic servers on 127.0.0.1:0, each on its
//! own tokio runtime so that shutting the runtime down kills the peer like a crashed process.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use keel_worker::allreduce::{
    Collective, Mailbox, Ring, RingConfig, WireDtype, ring_service, tune_server,
};
use rand::{RngExt, SeedableRng};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;

/// One ring peer: its runtime (server + all-reduces), address and mailbox.
pub struct Peer {
    pub rt: Runtime,
    pub addr: String,
    pub mailbox: Arc<Mailbox>,
}

pub fn start_peer() -> Peer {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mailbox = Mailbox::new();
    let service = ring_service(Arc::clone(&mailbox));
    rt.spawn(async move {
        tune_server(tonic::transport::Server::builder())
            .add_service(service)
            .serve_with_incoming(keel_net::incoming::nodelay_incoming(listener))
            .await
    });
    Peer { rt, addr, mailbox }
}

pub fn start_peers(n: usize) -> Vec<Peer> {
    (0..n).map(|_| start_peer()).collect()
}

pub fn config(peers: &[Peer], rank: usize, generation: u64) -> RingConfig {
    RingConfig {
        job_id: "job-test".to_string(),
        generation,
        rank: rank as u32,
        world_size: peers.len() as u32,
        peers: peers.iter().map(|p| p.addr.clone()).collect(),
        streams_per_link: 2,
        frame_bytes: 64 << 10,
        timeout: Duration::from_secs(20),
    }
}

/// Connects every peer's ring (concurrently, as a coordinator would), returning them by rank.
pub fn connect_all(
    peers: &[Peer],
    generation: u64,
    edit: impl Fn(&mut RingConfig),
) -> Vec<Arc<Ring>> {
    let handles: Vec<_> = peers
        .iter()
        .enumerate()
        .map(|(rank, p)| {
            let mut cfg = config(peers, rank, generation);
            edit(&mut cfg);
            let mailbox = Arc::clone(&p.mailbox);
            p.rt.spawn(async move { Ring::connect(cfg, mailbox).await })
        })
        .collect();
    handles
        .into_iter()
        .zip(peers)
        .map(|(h, p)| Arc::new(p.rt.block_on(h).unwrap().unwrap()))
        .collect()
}

/// Runs one all-reduce on every rank concurrently; returns each rank's buffer or error.
pub fn all_reduce(
    peers: &[Peer],
    rings: &[Arc<Ring>],
    step: u64,
    bucket: u32,
    inputs: Vec<Vec<f32>>,
) -> Vec<Result<Vec<f32>, keel_worker::allreduce::AllReduceError>> {
    all_reduce_as(peers, rings, step, bucket, inputs, &[WireDtype::F32])
}

/// [`all_reduce`] with each rank's elements sent as `dtypes[rank % dtypes.len()]`.
pub fn all_reduce_as(
    peers: &[Peer],
    rings: &[Arc<Ring>],
    step: u64,
    bucket: u32,
    inputs: Vec<Vec<f32>>,
    dtypes: &[WireDtype],
) -> Vec<Result<Vec<f32>, keel_worker::allreduce::AllReduceError>> {
    let all_reduce = [Collective::AllReduce];
    run_collective(
        peers,
        rings,
        (step, bucket),
        inputs,
        dtypes,
        &all_reduce,
        None,
    )
}

/// Runs `collectives[rank % len]` over each rank's input, sent as `dtypes[rank % len]`, on
/// every rank concurrently, rank `delayed` (if any) starting `delay` after the others;
/// returns each rank's buffer or error.
pub fn run_collective(
    peers: &[Peer],
    rings: &[Arc<Ring>],
    (step, bucket): (u64, u32),
    inputs: Vec<Vec<f32>>,
    dtypes: &[WireDtype],
    collectives: &[Collective],
    delayed: Option<(usize, Duration)>,
) -> Vec<Result<Vec<f32>, keel_worker::allreduce::AllReduceError>> {
    let handles: Vec<_> = peers
        .iter()
        .zip(rings)
        .zip(inputs)
        .enumerate()
        .map(|(rank, ((p, ring), data))| {
            let ring = Arc::clone(ring);
            let collective = collectives[rank % collectives.len()];
            let dtype = dtypes[rank % dtypes.len()];
            let wait = delayed
                .filter(|(r, _)| *r == rank)
                .map_or(Duration::ZERO, |(_, d)| d);
            p.rt.spawn(async move {
                tokio::time::sleep(wait).await;
                ring.collective(step, bucket, data, dtype, collective).await
            })
        })
        .collect();
    handles
        .into_iter()
        .zip(peers)
        .map(|(h, p)| p.rt.block_on(h).unwrap())
        .collect()
}

/// Serializes the tests of one binary that read the process's ring byte counter.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Bytes this process has sent on rings so far (`keel_worker_allreduce_bytes_total`).
pub fn ring_bytes_sent() -> u64 {
    let text = keel_worker::telemetry::encode(std::path::Path::new("/nonexistent"));
    text.lines()
        .find_map(|l| l.strip_prefix("keel_worker_allreduce_bytes_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .expect("keel_worker_allreduce_bytes_total in the worker's metrics")
}

pub fn integer_input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + rank * 13) % 101) as f32 - 50.0)
        .collect()
}

/// Uniform input in [-1, 1) of `rank`, reproducible from `seed`.
pub fn random_input(rank: usize, len: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed * 1000 + rank as u64);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}
