//! The model's own threads, for the work OpenBLAS does not do: elementwise kernels and the
//! many small per-(sequence, head) attention GEMMs, which run better as one single-threaded
//! GEMM per thread than as multi-threaded OpenBLAS calls (measured: 128x128x64 GEMMs drop
//! from ~12 to ~4 GFLOP/s with 2 OpenBLAS threads).
//!
//! The thread count is the one given to [`super::set_blas_threads`]. Work is split into
//! contiguous parts on scoped threads (the caller runs the first part), so results do not
//! depend on scheduling, and the elementwise results do not depend on the thread count.

use std::sync::atomic::{AtomicUsize, Ordering};

static THREADS: AtomicUsize = AtomicUsize::new(1);

unsafe extern "C" {
    fn openblas_set_num_threads(num_threads: std::ffi::c_int);
}

/// Sets OpenBLAS's thread count (process-wide).
fn set_openblas_threads(n: usize) {
    let n = n.clamp(1, i32::MAX as usize) as std::ffi::c_int;
    // SAFETY: OpenBLAS's documented setter; it takes any positive count.
    unsafe { openblas_set_num_threads(n) };
}

/// Sets the thread count of the model and of OpenBLAS.
pub(crate) fn set_threads(n: usize) {
    let n = n.max(1);
    THREADS.store(n, Ordering::Relaxed);
    set_openblas_threads(n);
}

/// The thread count set by [`set_threads`] (1 by default).
pub(crate) fn threads() -> usize {
    THREADS.load(Ordering::Relaxed)
}

/// Splits `0..items` into at most `parts` contiguous, nearly equal ranges (none empty).
pub(crate) fn split(items: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
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
pub(crate) fn zip_units<A: Send, B: Sync, R: Send>(
    out: &mut [A],
    out_unit: usize,
    inp: &[B],
    in_unit: usize,
    items: usize,
    min_items: usize,
    f: impl Fn(&mut [A], &[B]) -> R + Sync,
) -> Vec<R> {
    let parts = threads().min(items / min_items.max(1)).max(1);
    if parts == 1 {
        return vec![f(&mut out[..items * out_unit], &inp[..items * in_unit])];
    }
    let ranges = split(items, parts);
    std::thread::scope(|scope| {
        let mut rest = &mut out[..items * out_unit];
        let mut first = None;
        let mut handles = Vec::with_capacity(ranges.len());
        for (i, r) in ranges.iter().enumerate() {
            let (mine, tail) = rest.split_at_mut(r.len() * out_unit);
            rest = tail;
            let src = &inp[r.start * in_unit..r.end * in_unit];
            if i == 0 {
                first = Some((mine, src));
            } else {
                let f = &f;
                handles.push(scope.spawn(move || f(mine, src)));
            }
        }
        let mut results = Vec::with_capacity(ranges.len());
        if let Some((mine, src)) = first {
            results.push(f(mine, src));
        }
        for h in handles {
            match h.join() {
                Ok(r) => results.push(r),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        results
    })
}

/// Runs `f(work)` for each work item on its own thread (the first on the caller), with
/// OpenBLAS set to one thread meanwhile (each item calls GEMM itself).
pub(crate) fn run_with_single_threaded_blas<T: Send>(work: Vec<T>, f: impl Fn(T) + Sync) {
    if work.len() <= 1 {
        work.into_iter().for_each(f);
        return;
    }
    let n = threads();
    set_openblas_threads(1);
    std::thread::scope(|scope| {
        let mut items = work.into_iter();
        let first = items.next();
        for item in items {
            let f = &f;
            scope.spawn(move || f(item));
        }
        if let Some(item) = first {
            f(item);
        }
    });
    set_openblas_threads(n);
}

#[cfg(test)]
mod tests {
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
