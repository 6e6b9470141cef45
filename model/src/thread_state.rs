//! What belongs to one thread of the model's pool (`crate::parallel`), as a fact about that
//! thread: scratch buffers, whether it runs one part of a split, and the profiler's record of
//! the regions open on it.
//!
//! - Scratch: a GEMM may start on the step's thread or on a helper thread (attention's
//!   per-part work), and its scratch (the operands a native bf16 GEMM rounds for itself, the
//!   partial outputs of a GEMM cut along its sum) must not be shared between two GEMMs running
//!   at once; the pool's threads persist, so a buffer per thread is reused from step to step
//!   without allocating.
//! - The part mark: work started on a thread already running one part is not cut again.
//! - The profile (`crate::pass_profile`): regions nest per thread (an inner region's time is
//!   taken out of the one around it on the same thread), and helper threads record nothing.
//!
//! Nothing here chooses what is computed: the model's GEMM precision and its kept bf16 copies
//! are values passed with each call (`crate::gemms`, `crate::bf16_shared`). So this state
//! lives outside `model/`, as plain per-thread storage.

use std::cell::{Cell, RefCell};

thread_local! {
    /// A native GEMM's two operands rounded to bf16 bit patterns.
    static U16_PAIR: RefCell<(Vec<u16>, Vec<u16>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// The partial outputs of a GEMM cut along `k` (the MLM decoder's is `[v, c]`, 15 MiB at
    /// BERT-tiny: fresh pages every call would cost their zeroing).
    static PARTIALS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// True while this thread runs one part of a split: work inside it is not split again.
    static IN_PART: Cell<bool> = const { Cell::new(false) };
    /// True on the model's helper threads (set when the pool starts them): they do not record
    /// profile regions.
    static HELPER: Cell<bool> = const { Cell::new(false) };
    /// Nanoseconds spent in profile regions opened inside the innermost open one.
    static INNER: Cell<u64> = const { Cell::new(0) };
    /// The innermost open profile region's pass, as `crate::pass_profile::Pass`'s index
    /// (`None` when none is open).
    static OPEN: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Whether this thread runs one part of a split now.
pub(crate) fn in_part() -> bool {
    IN_PART.get()
}

/// Sets this thread's part mark; returns the mark before.
pub(crate) fn set_in_part(on: bool) -> bool {
    IN_PART.replace(on)
}

/// Marks this thread as one of the model's helper threads.
pub(crate) fn mark_helper() {
    HELPER.set(true);
}

/// Whether this thread is one of the model's helper threads.
pub(crate) fn is_helper() -> bool {
    HELPER.get()
}

/// Replaces the inner time of the innermost open profile region (nanoseconds); returns it.
pub(crate) fn replace_inner_nanos(nanos: u64) -> u64 {
    INNER.replace(nanos)
}

/// The inner time of the innermost open profile region (nanoseconds).
pub(crate) fn inner_nanos() -> u64 {
    INNER.get()
}

/// Replaces the innermost open profile region's pass index; returns the one before.
pub(crate) fn replace_open_pass(pass: Option<usize>) -> Option<usize> {
    OPEN.replace(pass)
}

/// Runs `f` with this thread's pair of bf16 buffers (contents left from the last call).
///
/// Panics if called again from inside `f` on the same thread (a caller's bug: a GEMM's
/// rounding never starts another GEMM).
pub(crate) fn with_u16_pair<R>(f: impl FnOnce(&mut Vec<u16>, &mut Vec<u16>) -> R) -> R {
    U16_PAIR.with_borrow_mut(|(a, b)| f(a, b))
}

/// Runs `f` with this thread's partial-output buffer (contents left from the last call).
///
/// Panics if called again from inside `f` on the same thread (a caller's bug).
pub(crate) fn with_partials<R>(f: impl FnOnce(&mut Vec<f32>) -> R) -> R {
    PARTIALS.with_borrow_mut(f)
}
