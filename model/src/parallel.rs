//! The model's threads. OpenBLAS itself always runs single-threaded; all parallel work is
//! cut here: elementwise kernels by rows, attention by sequences (its many small per-head
//! GEMMs run better as one single-threaded GEMM per thread: measured, 128x128x64 GEMMs drop
//! from ~12 to ~4 GFLOP/s with 2 OpenBLAS threads), and large GEMMs by blocks of rows or
//! columns of the output (`super::gemm`).
//!
//! The thread count is the one given to [`super::set_blas_threads`]. Work is split into
//! contiguous parts (the caller runs the first part, a persistent pool of `threads - 1`
//! helper threads the others), so results do not depend on scheduling, and the elementwise
//! results do not depend on the thread count. Work started on one of those threads is not
//! cut again. The helpers persist (a rayon pool) rather than being started per call: a fresh
//! thread per GEMM part cost its stack's page faults and unmapping (TLB shootdowns), and
//! oneDNN's and libgomp's per-thread set-up on every first call, which with native bf16 made
//! 2 threads only 1.13-1.17x faster than 1 (measured on a 2-core Zen 5 EPYC).

use super::pass_profile::Pass;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

static THREADS: AtomicUsize = AtomicUsize::new(1);

/// Runs `f` with this thread marked as running one part of a split (`crate::thread_state`
/// holds the mark: it is a fact about the thread); the mark is taken off again however `f`
/// ends (a panic too: the thread may be a pool thread that lives on). Nothing else crosses to
/// the helper: what the work computes (the GEMM route, bf16 copies) travels in `f`.
fn as_part<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            crate::thread_state::set_in_part(self.0);
        }
    }
    let _restore = Restore(crate::thread_state::set_in_part(true));
    f()
}

unsafe extern "C" {
    fn openblas_set_num_threads(num_threads: std::ffi::c_int);
    fn openblas_get_num_threads() -> std::ffi::c_int;
}

/// Sets OpenBLAS's thread count (process-wide).
pub(crate) fn set_openblas_threads(n: usize) {
    let n = n.clamp(1, i32::MAX as usize) as std::ffi::c_int;
    // SAFETY: OpenBLAS's documented setter; it takes any positive count.
    unsafe { openblas_set_num_threads(n) };
}

/// OpenBLAS's thread count now (process-wide). Until [`set_threads`] runs it is OpenBLAS's
/// own default (`OPENBLAS_NUM_THREADS`, else one per core), not 1.
pub(crate) fn openblas_threads() -> usize {
    // SAFETY: OpenBLAS's documented getter; no arguments.
    let n = unsafe { openblas_get_num_threads() };
    usize::try_from(n).unwrap_or(1).max(1)
}

/// The helper pool for `threads` model threads (`threads - 1` helpers), built on first use
/// and again when the count changes. `None` when the pool cannot be built (no threads can be
/// started): parts then run one after the other on the caller.
fn pool(threads: usize) -> Option<Arc<rayon::ThreadPool>> {
    static POOL: Mutex<Option<(usize, Arc<rayon::ThreadPool>)>> = Mutex::new(None);
    let mut slot = POOL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, p)) = slot.as_ref().filter(|(n, _)| *n == threads) {
        return Some(p.clone());
    }
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.saturating_sub(1).max(1))
        .thread_name(|i| format!("keel-model-{}", i + 1))
        .start_handler(|_| super::pass_profile::mark_helper_thread())
        .build();
    match built {
        Ok(p) => {
            let p = Arc::new(p);
            *slot = Some((threads, p.clone()));
            Some(p)
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not start the model's helper threads: running parts in turn");
            None
        }
    }
}

/// Runs `first` on the caller and each of `rest` on the helper pool, and returns when all
/// are done (a panic in a helper's part is raised here, after all have ended). Without a pool,
/// or on one of the pool's own threads (a split inside a part), the parts run in turn on the
/// caller: a pool thread waiting for parts queued behind it would wait for ever.
///
/// The caller spins a little (then parks) until the helpers' parts have ended, instead of
/// sleeping at once: the step thread is not one of the pool's, and a rayon scope's end would
/// put it to sleep on a condition variable, whose wake-up took ~100 us on a VM after the
/// helper's last part ended, for parts of ~1 ms (`keel-worker bench`, BERT-mini bf16, 2 threads, 2-core
/// Zen 5 EPYC, 2026-12-07, means over 1,900 splits: the step thread's part ended at 897 us,
/// the helper's ran from 5 to 911 us, and the split ended at 1,011 us).
fn fork_join<'s>(first: impl FnOnce() + Send + 's, rest: Vec<Box<dyn FnOnce() + Send + 's>>) {
    let Some(p) = pool(threads()).filter(|p| p.current_thread_index().is_none()) else {
        first();
        rest.into_iter().for_each(|job| job());
        return;
    };
    let parts = Arc::new(Parts {
        pending: AtomicUsize::new(0),
        panic: Mutex::new(None),
        caller: std::thread::current(),
    });
    // The wait for the helpers after `first`, timed until `_wait` has ended it: the split's
    // cost.
    let join;
    {
        // Dropped last, also when `first` panics: nothing borrowed from 's outlives this block.
        let _wait = WaitForParts(&parts);
        for job in rest {
            // SAFETY: only the lifetime is changed (the same fat pointer). The job borrows
            // from 's, which outlives this block, and `_wait` does not let the block end
            // (return or unwind) before `pending` says every job has ended: each job is run
            // and dropped before its `Parts::ended`.
            let job: Box<dyn FnOnce() + Send + 'static> = unsafe { std::mem::transmute(job) };
            parts.pending.fetch_add(1, Ordering::Relaxed);
            let parts = Arc::clone(&parts);
            p.spawn(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                parts.ended(result.err());
            });
        }
        first();
        join = super::pass_profile::region(Pass::Join, 0, 0);
    }
    drop(join);
    let panic = parts
        .panic
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .take();
    if let Some(payload) = panic {
        std::panic::resume_unwind(payload);
    }
}

/// The helpers' parts of one [`fork_join`] split.
struct Parts {
    /// Parts handed to the pool and not yet ended.
    pending: AtomicUsize,
    /// The first panic recorded by a part, raised on the caller once all have ended (unless
    /// the caller's own part panicked: that one is raised).
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// The caller, unparked when the last part ends (it may have stopped spinning).
    caller: std::thread::Thread,
}

impl Parts {
    /// Marks one part ended (with its panic, if it panicked).
    fn ended(&self, panic: Option<Box<dyn std::any::Any + Send>>) {
        if let Some(payload) = panic {
            let mut first = self
                .panic
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            first.get_or_insert(payload);
        }
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.caller.unpark();
        }
    }
}

/// How long the caller spins for the helpers before it parks. Long enough for parts that end
/// within a few microseconds of each other (the common case: the wake-up it saves is ~100 us);
/// short enough that, with more runnable threads than cores (a build beside the worker, the
/// ring's network threads during the backward), the caller soon gives its core to a helper
/// that needs it: spinning without a bound made a BERT-tiny step on 2 threads 2x slower on a
/// loaded 2-core machine.
const SPIN_BEFORE_PARKING: std::time::Duration = std::time::Duration::from_micros(50);

/// Waits, when dropped, until every part of the split has ended: spins for
/// [`SPIN_BEFORE_PARKING`], then parks until the last part's end unparks it.
struct WaitForParts<'a>(&'a Parts);

impl Drop for WaitForParts<'_> {
    fn drop(&mut self) {
        let pending = &self.0.pending;
        let start = std::time::Instant::now();
        let mut spins = 0u32;
        while pending.load(Ordering::Acquire) > 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && start.elapsed() >= SPIN_BEFORE_PARKING {
                // A wake-up after the check is not lost: `unpark` before `park` makes it return.
                while pending.load(Ordering::Acquire) > 0 {
                    std::thread::park();
                }
                return;
            }
            std::hint::spin_loop();
        }
    }
}

/// Open [`Hot`] guards: while any is open, the helpers spin for work instead of sleeping.
static HOT: AtomicUsize = AtomicUsize::new(0);
/// Spinning loops started by [`hot`] and not yet ended.
static SPINNERS: AtomicUsize = AtomicUsize::new(0);

/// While alive, the model's helper threads look for work without going to sleep (see [`hot`]).
#[must_use = "the helpers stay hot until the guard is dropped"]
pub struct Hot(());

impl Drop for Hot {
    fn drop(&mut self) {
        HOT.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Keeps the helper threads hot until the guard is dropped: each runs a loop that takes the
/// next part as soon as it is handed out (`rayon::yield_now`), yielding its core to any other
/// runnable thread (`sched_yield`) while there is none, instead of sleeping. A rayon helper
/// that sleeps between parts is woken by a futex wake, and on a VM that took ~100 us a split:
/// the 121 splits of a BERT-tiny step left the step thread waiting 17-24 ms for its helper,
/// 6-8 ms with the helpers hot, and the step went from 32-34 k to 36-37 k tokens/s
/// (`keel-worker bench`, 2 threads, AMX Xeon, 2026-12-05). Open it around a step's compute,
/// not around waits for the network.
pub fn hot() -> Hot {
    static START: Mutex<()> = Mutex::new(());
    let _one_at_a_time = START
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    HOT.fetch_add(1, Ordering::AcqRel);
    let threads = threads();
    let wanted = threads.saturating_sub(1);
    if threads > 1
        && let Some(p) = pool(threads)
    {
        // A loop that saw the guards all closed may still be ending: then this step runs
        // with one hot helper fewer, never with more loops than helpers.
        while SPINNERS.load(Ordering::Acquire) < wanted {
            SPINNERS.fetch_add(1, Ordering::AcqRel);
            p.spawn(|| {
                while HOT.load(Ordering::Acquire) > 0 {
                    if rayon::yield_now() != Some(rayon::Yield::Executed) {
                        std::thread::yield_now();
                    }
                }
                SPINNERS.fetch_sub(1, Ordering::AcqRel);
            });
        }
    }
    Hot(())
}

/// Sets the thread count of the model; OpenBLAS is set to one thread.
pub fn set_threads(n: usize) {
    let n = n.max(1);
    THREADS.store(n, Ordering::Relaxed);
    set_openblas_threads(1);
}

/// The thread count set by [`set_threads`] (1 by default).
pub fn threads() -> usize {
    THREADS.load(Ordering::Relaxed)
}

/// The threads work started here may be cut among: [`threads`], or 1 on a thread that is
/// already running one part of a split.
pub fn available_threads() -> usize {
    if crate::thread_state::in_part() {
        1
    } else {
        threads()
    }
}

/// Splits `0..items` into at most `parts` contiguous, nearly equal ranges (none empty).
pub fn split(items: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let parts = parts.clamp(1, items.max(1));
    (0..parts)
        .map(|p| p * items / parts..(p + 1) * items / parts)
        .filter(|r| !r.is_empty())
        .collect()
}

/// Runs `f(out_part, in_part)` over matching parts of `out` and `inp`, both made of `items`
/// units of `out_unit` / `in_unit` elements, on up to [`threads`] threads (at least
/// `min_items` units each); returns the parts' results in order.
#[allow(clippy::too_many_arguments)]
pub fn zip_units<A: Send, B: Sync, R: Send>(
    out: &mut [A],
    out_unit: usize,
    inp: &[B],
    in_unit: usize,
    items: usize,
    min_items: usize,
    f: impl Fn(&mut [A], &[B]) -> R + Sync,
) -> Vec<R> {
    let parts = available_threads().min(items / min_items.max(1)).max(1);
    zip_parts(parts, out, out_unit, inp, in_unit, items, f)
}

/// [`zip_units`] cut into exactly `parts` parts (fewer only when there are fewer units), run on
/// the helper pool as it is: for tests that need a cut whatever the thread count.
#[allow(clippy::too_many_arguments)]
pub fn zip_parts<A: Send, B: Sync, R: Send>(
    parts: usize,
    out: &mut [A],
    out_unit: usize,
    inp: &[B],
    in_unit: usize,
    items: usize,
    f: impl Fn(&mut [A], &[B]) -> R + Sync,
) -> Vec<R> {
    let parts = parts.clamp(1, items.max(1));
    if parts == 1 {
        return vec![f(&mut out[..items * out_unit], &inp[..items * in_unit])];
    }
    let ranges = split(items, parts);
    let mut results: Vec<Option<R>> = (0..ranges.len()).map(|_| None).collect();
    let mut rest = &mut out[..items * out_unit];
    let mut work = Vec::with_capacity(ranges.len());
    for (r, slot) in ranges.iter().zip(results.iter_mut()) {
        let (mine, tail) = rest.split_at_mut(r.len() * out_unit);
        rest = tail;
        work.push((mine, &inp[r.start * in_unit..r.end * in_unit], slot));
    }
    let f = &f;
    let mut work = work.into_iter();
    let first = work.next();
    let others: Vec<Box<dyn FnOnce() + Send + '_>> = work
        .map(|(mine, src, slot)| {
            Box::new(move || *slot = Some(as_part(|| f(mine, src))))
                as Box<dyn FnOnce() + Send + '_>
        })
        .collect();
    fork_join(
        move || {
            if let Some((mine, src, slot)) = first {
                *slot = Some(as_part(|| f(mine, src)));
            }
        },
        others,
    );
    results
        .into_iter()
        .map(|r| r.expect("fork_join ran every part (a panic would have been raised)"))
        .collect()
}

/// Fewest elements of a memory pass (a fill, a sum) worth a thread of their own.
const MIN_PASS_ELEMENTS: usize = 1 << 16;

/// Sets every element of `x` to `value`, cut among the model's threads (a gradient buffer of
/// millions of elements is a pass over memory one thread does not saturate).
pub fn fill<A: Copy + Send + Sync>(x: &mut [A], value: A) {
    let none: &[A] = &[];
    zip_units(x, 1, none, 0, x.len(), MIN_PASS_ELEMENTS, |part, _| {
        part.fill(value)
    });
}

/// `f(part)` over `x` cut into contiguous parts among the model's threads, in place.
pub fn for_each_part<A: Send + Sync>(x: &mut [A], f: impl Fn(&mut [A]) + Sync) {
    let none: &[A] = &[];
    zip_units(x, 1, none, 0, x.len(), MIN_PASS_ELEMENTS, |part, _| f(part));
}

/// Runs `f(work)` for each work item, the first on the caller and the others on the helper
/// pool (more items than helpers queue up on them; without a pool, or on one of its threads,
/// all run in turn on the caller); GEMMs and elementwise work inside an item are not split
/// again.
pub fn run_parts<T: Send>(work: Vec<T>, f: impl Fn(T) + Sync) {
    if work.len() <= 1 {
        work.into_iter().for_each(f);
        return;
    }
    let f = &f;
    let mut items = work.into_iter();
    let first = items.next();
    let others: Vec<Box<dyn FnOnce() + Send + '_>> = items
        .map(|item| Box::new(move || as_part(|| f(item))) as Box<dyn FnOnce() + Send + '_>)
        .collect();
    fork_join(
        move || {
            if let Some(item) = first {
                as_part(|| f(item));
            }
        },
        others,
    );
}

#[cfg(test)]
mod tests {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// Runs three parts (the first on the caller, two on the helper pool); the part whose
    /// input is `panicking` panics at once, the others sleep and then count themselves as
    /// ended. Returns the panic's message, and how many of the other parts had ended when it
    /// reached the caller.
    fn split_with_a_panic(panicking: u8) -> (String, usize) {
        let ended = AtomicUsize::new(0);
        let mut out = [0u8; 3];
        let caught = catch_unwind(AssertUnwindSafe(|| {
            super::zip_parts(3, &mut out, 1, &[0u8, 1, 2], 1, 3, |_, part| {
                if part[0] == panicking {
                    panic!("part {panicking}");
                }
                std::thread::sleep(Duration::from_millis(30));
                ended.fetch_add(1, Ordering::SeqCst);
            });
        }));
        let payload = caught.expect_err("the split raises its part's panic");
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        (message, ended.load(Ordering::SeqCst))
    }

    /// A split inside a part that runs on a helper thread ends: its parts run in turn there
    /// (a helper waiting for parts queued behind it on itself would wait for ever).
    #[test]
    fn a_split_inside_a_helpers_part_ends() {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut out = [0u32; 4];
            super::zip_parts(2, &mut out, 2, &[1u32, 2], 1, 2, |outer, x| {
                let inner = [x[0], x[0] * 10];
                super::zip_parts(2, outer, 1, &inner, 1, 2, |o, i| o[0] = i[0]);
            });
            let _ = done.send(out);
        });
        let out = finished
            .recv_timeout(Duration::from_secs(20))
            .expect("the nested split ended within 20 s");
        assert_eq!(out, [1, 10, 2, 20]);
    }

    /// A helper's panic reaches the caller only once every other part has ended.
    #[test]
    fn a_helper_part_panic_is_raised_after_every_part_ended() {
        assert_eq!(split_with_a_panic(2), ("part 2".to_string(), 2));
    }

    /// A panic of the caller's own part waits for the helpers' parts, which borrow the
    /// caller's buffers, before it unwinds past the split.
    #[test]
    fn the_callers_panic_waits_for_the_helpers() {
        assert_eq!(split_with_a_panic(0), ("part 0".to_string(), 2));
    }

    #[test]
    fn split_covers_exactly() {
        for items in 0..20 {
            for parts in 1..6 {
                let r = super::split(items, parts);
                let mut next = 0;
                for x in &r {
                    assert_eq!(x.start, next);
                    assert!(!x.is_empty());
                    next = x.end;
                }
                assert_eq!(next, items);
            }
        }
    }
}
