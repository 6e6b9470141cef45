//! The ring over memory: [`MemoryNetwork`] is a [`Transport`] whose links hand frames straight
//! to the receiving rank's [`Mailbox`] in the same process, through the same admission and the
//! same refusal codes as the gRPC service, with faults drawn on the way ([`LinkFaults`]: a link
//! that breaks, a frame lost after its ack, delivered twice, held back so that later ones
//! overtake it, or cut short; a peer that vanishes). Tests and simulations run the real
//! all-reduce, reduce-scatter and all-gather on hundreds of ranks with it, without a socket.
//!
//! Faults are drawn from one seeded generator (ChaCha8) in the order pushes reach the
//! network: a run on one thread repeats exactly; on several, the schedule also depends on how
//! the tasks interleave.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::future::BoxFuture;
use keel_proto::ring_rpc::RingFrame;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::time::Instant;

use super::mailbox::Mailbox;
use super::transport::{Ack, Link, Transport};

/// How often each fault strikes a push, as probabilities in `0..=1` (all 0: a perfect
/// network). At most one of `fail`, `lose`, `duplicate` and `truncate` strikes a push; `delay`
/// may come on top of any of them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinkFaults {
    /// The link breaks before the frame lands: the push answers `UNAVAILABLE` and the sender
    /// tries again.
    pub fail: f64,
    /// The frame is lost after the receiver's ack was faked: the sender believes it landed
    /// (what a sender whose peer crashed right after acking sees). The receiver times out.
    pub lose: f64,
    /// The frame lands twice (a retry after a lost ack): the second copy is refused with
    /// `ALREADY_EXISTS`, and the sender sees the first answer.
    pub duplicate: f64,
    /// The frame is held back for up to `max_delay` (uniform), so later frames overtake it.
    pub delay: f64,
    /// Longest hold of a delayed frame.
    pub max_delay: Duration,
    /// The frame's payload is cut to half its bytes on the way: the receiver refuses it.
    pub truncate: f64,
}

/// How many of each fault a [`MemoryNetwork`] injected so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Pushes answered `UNAVAILABLE` by a broken link.
    pub failed: u64,
    /// Frames lost after a faked ack.
    pub lost: u64,
    /// Frames delivered twice.
    pub duplicated: u64,
    /// Frames held back.
    pub delayed: u64,
    /// Frames cut short.
    pub truncated: u64,
    /// Pushes to a peer no longer attached.
    pub to_absent: u64,
}

/// Peers' mailboxes by address, in one process; clones share the network.
#[derive(Clone)]
pub struct MemoryNetwork {
    shared: Arc<Shared>,
}

struct Shared {
    /// Attached peers: `host:port` -> its mailbox.
    peers: Mutex<HashMap<String, Arc<Mailbox>>>,
    /// The faults and the generator they are drawn from.
    faults: Mutex<(LinkFaults, ChaCha8Rng)>,
    /// What was injected.
    counts: [AtomicU64; 6],
}

/// What one push suffers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fate {
    Deliver,
    Fail,
    Lose,
    Duplicate,
    Truncate,
}

impl MemoryNetwork {
    /// An empty network whose faults are drawn from `seed`; none until
    /// [`MemoryNetwork::set_faults`].
    pub fn new(seed: u64) -> MemoryNetwork {
        MemoryNetwork {
            shared: Arc::new(Shared {
                peers: Mutex::new(HashMap::new()),
                faults: Mutex::new((LinkFaults::default(), ChaCha8Rng::seed_from_u64(seed))),
                counts: Default::default(),
            }),
        }
    }

    /// Makes `mailbox` reachable at `addr` (replacing what was there).
    pub fn attach(&self, addr: &str, mailbox: Arc<Mailbox>) {
        lock(&self.shared.peers).insert(addr.to_string(), mailbox);
    }

    /// Makes `addr` unreachable, as a peer that died: pushes to it answer `UNAVAILABLE`,
    /// connections to it wait for it to come back until their deadline.
    pub fn detach(&self, addr: &str) {
        lock(&self.shared.peers).remove(addr);
    }

    /// From now on, every push suffers `faults`.
    pub fn set_faults(&self, faults: LinkFaults) {
        lock(&self.shared.faults).0 = faults;
    }

    /// The faults injected so far.
    pub fn injected(&self) -> FaultCounts {
        let c = |i: usize| self.shared.counts[i].load(Ordering::Relaxed);
        FaultCounts {
            failed: c(0),
            lost: c(1),
            duplicated: c(2),
            delayed: c(3),
            truncated: c(4),
            to_absent: c(5),
        }
    }
}

impl Shared {
    fn count(&self, i: usize) {
        self.counts[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Draws what a push suffers, and how long it is held back.
    fn draw(&self) -> (Fate, Option<Duration>) {
        let mut guard = lock(&self.faults);
        let (f, rng) = &mut *guard;
        let delay = (f.delay > 0.0 && rng.random_bool(f.delay.clamp(0.0, 1.0)))
            .then(|| f.max_delay.mul_f64(rng.random::<f64>()));
        let x: f64 = rng.random();
        let mut edge = 0.0;
        let mut fate = Fate::Deliver;
        for (p, candidate) in [
            (f.fail, Fate::Fail),
            (f.lose, Fate::Lose),
            (f.duplicate, Fate::Duplicate),
            (f.truncate, Fate::Truncate),
        ] {
            edge += p.max(0.0);
            if x < edge {
                fate = candidate;
                break;
            }
        }
        (fate, delay)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing here can be left half-changed by a panic: keep going.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One link to the peer at `addr`.
struct MemoryLink {
    shared: Arc<Shared>,
    addr: String,
}

impl Link for MemoryLink {
    fn push(&self, mut frame: RingFrame) -> BoxFuture<'_, Ack> {
        Box::pin(async move {
            // The receiver gets its own bytes, as over a network: the sender's payload may
            // point into the buffer it reduces, which it writes again once the push is over
            // (the contract of `Link::push`). Sharing it was a bug the seeded simulation found
            // (seed 285: a forwarded all-gather frame kept the sender's range alive).
            frame.data = bytes::Bytes::copy_from_slice(&frame.data);
            let (fate, delay) = self.shared.draw();
            if let Some(d) = delay {
                self.shared.count(3);
                tokio::time::sleep(d).await;
            }
            let Some(mailbox) = lock(&self.shared.peers).get(&self.addr).cloned() else {
                self.shared.count(5);
                return Err(tonic::Status::unavailable(format!(
                    "in-memory peer {} is gone",
                    self.addr
                )));
            };
            match fate {
                Fate::Deliver => {}
                Fate::Fail => {
                    self.shared.count(0);
                    return Err(tonic::Status::unavailable(
                        "injected: the link broke before the frame landed",
                    ));
                }
                Fate::Lose => {
                    self.shared.count(1);
                    return Ok(());
                }
                Fate::Duplicate => {
                    self.shared.count(2);
                    let first = mailbox.deliver(frame.clone()).await;
                    // The copy's answer goes nowhere, as a retry's after a lost ack.
                    let _ = mailbox.deliver(frame).await;
                    return first.map_err(tonic::Status::from);
                }
                Fate::Truncate => {
                    self.shared.count(4);
                    frame.data = frame.data.slice(..frame.data.len() / 2);
                }
            }
            mailbox.deliver(frame).await.map_err(tonic::Status::from)
        })
    }
}

/// Pause between looks for a peer that is not attached yet.
const CONNECT_POLL: Duration = Duration::from_millis(5);

impl Transport for MemoryNetwork {
    fn connect<'a>(
        &'a self,
        addr: &'a str,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<Box<dyn Link>, String>> {
        Box::pin(async move {
            loop {
                if lock(&self.shared.peers).contains_key(addr) {
                    let link: Box<dyn Link> = Box::new(MemoryLink {
                        shared: Arc::clone(&self.shared),
                        addr: addr.to_string(),
                    });
                    return Ok(link);
                }
                if Instant::now() + CONNECT_POLL >= deadline {
                    return Err(format!("no in-memory peer at {addr} by the deadline"));
                }
                tokio::time::sleep(CONNECT_POLL).await;
            }
        })
    }
}
