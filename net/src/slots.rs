//! Slots for those who prove themselves: the bookkeeping behind a server's connection cap.
//!
//! Without the cluster token a stranger can still open connections, send the HTTP/2 preface
//! and answer the server's pings; a plain cap let 512 such connections lock every worker and
//! `keel` out. Here a connection is *unproven* from its accept until its first call carrying
//! the token ([`Proof::prove`], called by [`crate::auth::RequireToken`]), and only proven
//! connections are safe:
//!
//! 1. Unproven connections hold at most `max_unproven` slots, proven ones the rest of the cap.
//! 2. A new connection that finds no room evicts an unproven one instead of being refused: the
//!    oldest of the source address that holds the most unproven slots. A stranger flooding from
//!    one address evicts only its own connections while others hold fewer; from one address
//!    (everything on 127.0.0.1) this is plain oldest-first, so a newcomer has until
//!    `max_unproven` newer connections arrive to make its first call, milliseconds for `keel`
//!    and the workers. Nothing is refused per address: a local cluster of many workers on one
//!    address is never held back, and its connections prove themselves at once.
//! 3. Only when every slot is proven is a new connection refused (a real overload).
//!
//! An evicted connection is woken ([`Slot`] keeps the waker of its last pending read or write)
//! and its reads and writes fail once its linger has passed, so that the server closes it.
//! On the HTTP port nothing is ever proven (Prometheus has no token): every connection is
//! evictable, and the port lets an evicted connection finish the request it is serving.
//!
//! The pool owns no socket and no clock: the tests below drive it directly.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::task::Waker;

use tokio::sync::Notify;
use tokio::time::Instant;

/// [`Slot::state`]: accepted, no call with the token yet.
const UNPROVEN: u8 = 0;
/// [`Slot::state`]: a call carried the token; never evicted.
const PROVEN: u8 = 1;
/// [`Slot::state`]: evicted to make room; the connection is closing.
const EVICTED: u8 = 2;

/// The slots of one server's connections.
#[derive(Debug)]
pub struct SlotPool {
    /// Open connections at most, proven or not.
    max_total: usize,
    /// Unproven connections at most (at most `max_total`).
    max_unproven: usize,
    /// Who holds which slot.
    state: Mutex<PoolState>,
}

/// [`SlotPool`]'s books, behind its lock.
#[derive(Debug, Default)]
struct PoolState {
    /// Connections holding a slot (evicted ones no longer do).
    open: usize,
    /// The next slot's id: ids grow with accept time, so the smallest is the oldest.
    next_id: u64,
    /// Unproven connections by id (oldest first), to evict them.
    unproven: BTreeMap<u64, Arc<Slot>>,
    /// The ids of the unproven connections of each source address, to find the address that
    /// holds the most and its oldest connection.
    by_addr: HashMap<IpAddr, BTreeSet<u64>>,
}

/// What [`SlotPool::admit`] did with a new connection.
#[derive(Debug)]
pub enum Admission {
    /// Admitted; `evicted` is the connection evicted to make room, if one was.
    Admitted {
        /// The new connection's slot (give it back by dropping it).
        slot: SlotGuard,
        /// The source address of the evicted connection.
        evicted: Option<IpAddr>,
    },
    /// Refused: every slot is held by a proven connection.
    Refused,
}

/// One connection's place in a [`SlotPool`].
#[derive(Debug)]
pub struct Slot {
    /// Order of acceptance (smaller: older).
    id: u64,
    /// The peer's address (for the per-address choice of whom to evict).
    addr: IpAddr,
    /// [`UNPROVEN`], [`PROVEN`] or [`EVICTED`].
    state: AtomicU8,
    /// When the slot was evicted (set once).
    evicted_at: OnceLock<Instant>,
    /// The task to wake when the slot is evicted (the one polling the connection's I/O).
    waker: Mutex<Option<Waker>>,
    /// Tells the HTTP port's connection task of an eviction (a stored permit, so that an
    /// eviction before the task waits is not lost).
    evicted: Notify,
    /// The pool, to move the slot between its books (weak: the pool holds unproven slots).
    pool: Weak<SlotPool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks; if it did, the books are still usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl SlotPool {
    /// A pool of `max_total` slots of which unproven connections may hold `max_unproven`
    /// (clamped to `1..=max_total`).
    pub fn new(max_total: usize, max_unproven: usize) -> Arc<SlotPool> {
        let max_total = max_total.max(1);
        Arc::new(SlotPool {
            max_total,
            max_unproven: max_unproven.clamp(1, max_total),
            state: Mutex::new(PoolState::default()),
        })
    }

    /// Connections holding a slot now.
    pub fn open(&self) -> usize {
        lock(&self.state).open
    }

    /// Unproven connections holding a slot now.
    pub fn unproven(&self) -> usize {
        lock(&self.state).unproven.len()
    }

    /// Finds a slot for a new connection from `addr`, evicting an unproven one if there is no
    /// room (see the module doc); refuses only when every slot is proven.
    pub fn admit(self: &Arc<Self>, addr: IpAddr) -> Admission {
        let mut st = lock(&self.state);
        let mut evicted = None;
        if st.unproven.len() >= self.max_unproven || st.open >= self.max_total {
            let Some(victim) = st.victim() else {
                return Admission::Refused;
            };
            st.forget_unproven(&victim);
            st.open -= 1;
            victim.mark_evicted();
            evicted = Some(victim.addr);
        }
        let id = st.next_id;
        st.next_id += 1;
        let slot = Arc::new(Slot {
            id,
            addr,
            state: AtomicU8::new(UNPROVEN),
            evicted_at: OnceLock::new(),
            waker: Mutex::new(None),
            evicted: Notify::new(),
            pool: Arc::downgrade(self),
        });
        st.open += 1;
        st.unproven.insert(id, slot.clone());
        st.by_addr.entry(addr).or_default().insert(id);
        Admission::Admitted {
            slot: SlotGuard(slot),
            evicted,
        }
    }

    /// Moves `slot` to the proven connections (no-op unless it is unproven).
    fn prove(&self, slot: &Slot) {
        let mut st = lock(&self.state);
        if slot
            .state
            .compare_exchange(UNPROVEN, PROVEN, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            st.forget_unproven(slot);
        }
    }

    /// Gives back `slot`'s place (its connection was dropped).
    fn release(&self, slot: &Slot) {
        let mut st = lock(&self.state);
        match slot.state.load(Ordering::Acquire) {
            // Its place was given back when it was evicted.
            EVICTED => {}
            state => {
                if state == UNPROVEN {
                    st.forget_unproven(slot);
                }
                st.open = st.open.saturating_sub(1);
                // No eviction after the release: the connection is gone.
                slot.state.store(EVICTED, Ordering::Release);
            }
        }
    }
}

impl PoolState {
    /// The unproven connection to evict: the oldest of the address holding the most unproven
    /// slots (ties: the address whose oldest is older). `None` when none is unproven.
    fn victim(&self) -> Option<Arc<Slot>> {
        let (_, ids) = self
            .by_addr
            .iter()
            .filter_map(|(addr, ids)| Some((addr, ids, *ids.first()?)))
            .max_by(|a, b| a.1.len().cmp(&b.1.len()).then(b.2.cmp(&a.2)))
            .map(|(addr, ids, _)| (addr, ids))?;
        let oldest = ids.first()?;
        self.unproven.get(oldest).cloned()
    }

    /// Removes `slot` from the unproven books.
    fn forget_unproven(&mut self, slot: &Slot) {
        self.unproven.remove(&slot.id);
        if let Some(ids) = self.by_addr.get_mut(&slot.addr) {
            ids.remove(&slot.id);
            if ids.is_empty() {
                self.by_addr.remove(&slot.addr);
            }
        }
    }
}

impl Slot {
    /// Whether a call with the token came on this connection.
    pub fn is_proven(&self) -> bool {
        self.state.load(Ordering::Acquire) == PROVEN
    }

    /// When this connection was evicted; `None` while it holds its slot.
    pub fn evicted_at(&self) -> Option<Instant> {
        self.evicted_at.get().copied()
    }

    /// Marks the slot evicted and wakes its connection.
    fn mark_evicted(&self) {
        if self
            .state
            .compare_exchange(UNPROVEN, EVICTED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let _ = self.evicted_at.set(Instant::now());
            if let Some(waker) = lock(&self.waker).take() {
                waker.wake();
            }
            self.evicted.notify_one();
        }
    }

    /// Remembers `waker` as the task to wake on eviction (only while it can be evicted).
    pub fn register(&self, waker: &Waker) {
        if self.state.load(Ordering::Acquire) != UNPROVEN {
            return;
        }
        let mut slot = lock(&self.waker);
        match &*slot {
            Some(w) if w.will_wake(waker) => {}
            _ => *slot = Some(waker.clone()),
        }
    }

    /// Resolves once the slot is evicted (never for a proven one).
    pub async fn evicted(&self) {
        if self.evicted_at().is_some() {
            return;
        }
        self.evicted.notified().await;
    }
}

/// A connection's slot, given back to the pool when dropped.
#[derive(Debug)]
pub struct SlotGuard(Arc<Slot>);

impl SlotGuard {
    /// The slot.
    pub fn slot(&self) -> &Arc<Slot> {
        &self.0
    }

    /// The handle that proves this connection (for the request extensions).
    pub fn proof(&self) -> Proof {
        Proof(self.0.clone())
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if let Some(pool) = self.0.pool.upgrade() {
            pool.release(&self.0);
        }
    }
}

/// Marks a connection proven: its first call with the cluster token moves it to the slots
/// no stranger can take. Cloned into every request of the connection.
#[derive(Clone, Debug)]
pub struct Proof(Arc<Slot>);

impl Proof {
    /// Marks the connection proven (no-op when it already is, or was evicted meanwhile).
    pub fn prove(&self) {
        if self.0.state.load(Ordering::Acquire) != UNPROVEN {
            return;
        }
        if let Some(pool) = self.0.pool.upgrade() {
            pool.prove(&self.0);
        }
    }

    /// Whether the connection is proven.
    pub fn is_proven(&self) -> bool {
        self.0.is_proven()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn admit(pool: &Arc<SlotPool>, addr: IpAddr) -> (SlotGuard, Option<IpAddr>) {
        match pool.admit(addr) {
            Admission::Admitted { slot, evicted } => (slot, evicted),
            Admission::Refused => panic!("refused"),
        }
    }

    #[test]
    fn a_full_pool_evicts_the_oldest_unproven_and_never_a_proven_one() {
        let pool = SlotPool::new(4, 4);
        let (a, _) = admit(&pool, ip(1));
        let (b, _) = admit(&pool, ip(1));
        b.proof().prove();
        let (c, _) = admit(&pool, ip(1));
        let (_d, _) = admit(&pool, ip(1));
        assert_eq!((pool.open(), pool.unproven()), (4, 3));
        // Full: the newcomer evicts the oldest unproven one (a), not the proven b.
        let (_e, evicted) = admit(&pool, ip(1));
        assert_eq!(evicted, Some(ip(1)));
        assert!(a.slot().evicted_at().is_some());
        assert!(b.slot().evicted_at().is_none() && b.slot().is_proven());
        assert_eq!((pool.open(), pool.unproven()), (4, 3));
        // Dropping an evicted connection gives nothing back twice.
        drop(a);
        assert_eq!(pool.open(), 4);
        drop(c);
        assert_eq!((pool.open(), pool.unproven()), (3, 2));
    }

    #[test]
    fn only_a_pool_of_proven_connections_refuses() {
        let pool = SlotPool::new(2, 2);
        let held: Vec<SlotGuard> = (0..2).map(|_| admit(&pool, ip(1)).0).collect();
        for s in &held {
            s.proof().prove();
        }
        assert!(matches!(pool.admit(ip(2)), Admission::Refused));
        drop(held);
        assert_eq!(pool.open(), 0);
        assert!(matches!(pool.admit(ip(2)), Admission::Admitted { .. }));
    }

    #[test]
    fn unproven_connections_hold_at_most_their_budget() {
        let pool = SlotPool::new(10, 3);
        let first: Vec<SlotGuard> = (0..3).map(|_| admit(&pool, ip(1)).0).collect();
        let (_fourth, evicted) = admit(&pool, ip(1));
        assert_eq!(evicted, Some(ip(1)));
        assert!(first[0].slot().evicted_at().is_some());
        assert_eq!((pool.open(), pool.unproven()), (3, 3));
        // Proven ones make room in the budget and use the rest of the cap.
        for s in &first[1..] {
            s.proof().prove();
        }
        assert_eq!((pool.open(), pool.unproven()), (3, 1));
    }

    #[test]
    fn the_address_holding_the_most_loses_its_oldest() {
        let pool = SlotPool::new(6, 6);
        let (legit, _) = admit(&pool, ip(9));
        let attacker: Vec<SlotGuard> = (0..5).map(|_| admit(&pool, ip(1)).0).collect();
        // The stranger's new connections evict only its own, oldest first, even though the
        // legitimate one is older.
        let mut newer = Vec::new();
        for old in &attacker {
            let (s, evicted) = admit(&pool, ip(1));
            assert_eq!(evicted, Some(ip(1)));
            assert!(old.slot().evicted_at().is_some());
            newer.push(s);
        }
        assert!(legit.slot().evicted_at().is_none());
        // Another newcomer too evicts from the address holding the most.
        let (_other, evicted) = admit(&pool, ip(7));
        assert_eq!(evicted, Some(ip(1)));
        assert!(legit.slot().evicted_at().is_none());
    }

    #[test]
    fn proving_after_an_eviction_changes_nothing() {
        let pool = SlotPool::new(1, 1);
        let (a, _) = admit(&pool, ip(1));
        let (_b, _) = admit(&pool, ip(1));
        a.proof().prove();
        assert!(!a.proof().is_proven());
        assert_eq!((pool.open(), pool.unproven()), (1, 1));
    }

    #[tokio::test]
    async fn eviction_wakes_the_connection_and_its_task() {
        let pool = SlotPool::new(1, 1);
        let (a, _) = admit(&pool, ip(1));
        let slot = a.slot().clone();
        let waiter = tokio::spawn(async move { slot.evicted().await });
        tokio::task::yield_now().await;
        let (_b, _) = admit(&pool, ip(1));
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("the eviction was not signalled")
            .expect("task");
    }
}
