//! Operands rounded to bf16 once and read by several native GEMMs.
//!
//! Without this, the native route (`super::bf16::native_gemm_f32`) rounds both operands of
//! every call: a weight once in forward and again for its input gradient, a layer's input
//! once for each of the query, key and value projections in forward and again for each of
//! their weight gradients, an output gradient `dy` once for the weight gradient and again for
//! the input gradient. [`share`] rounds a whole slice once, up front, and until its guard is
//! dropped every native GEMM whose operand view lies inside that slice reads the copy, with
//! the view's own strides (so `W` and `W^T` are both served by one copy of `W`).
//!
//! The values the GEMMs see are the same bits as before (the same rounding of the same
//! numbers), so results are bit-identical; only the number of passes over memory changes.
//!
//! A copy can also outlive one scope: [`keep`] rounds an activation into a buffer the caller
//! owns (a layer's cache), and [`share_kept`] lends that buffer to the GEMMs of a later scope.
//! A layer's forward keeps the bf16 copies of its GEMMs' inputs and its backward reads them
//! for the weight gradients, instead of rounding the same activations a second time.
//!
//! Scoping: the guard borrows the slice (and a kept copy) for its whole life, so safe code
//! cannot change either while the copy is in use. Registrations are per thread (the GEMMs that
//! read them are started on the thread that shared them); a GEMM on another thread converts as
//! before.

use std::any::TypeId;
use std::cell::RefCell;
use std::marker::PhantomData;

use keel_proto::precision::Precision;
use ndarray::{ArrayView2, ShapeBuilder};

/// One shared slice: its address range and its bf16 bit patterns.
struct Region {
    /// Address of the first f32.
    start: usize,
    /// Length in f32 elements.
    len: usize,
    /// `[len]` bf16 bit patterns, element `i` of the slice at `copy[i]`.
    copy: Copy16,
}

/// Where a region's bf16 bit patterns live.
enum Copy16 {
    /// Made by [`share`], dropped (its buffer kept for reuse) with the guard.
    Owned(Vec<u16>),
    /// A caller's buffer lent by [`share_kept`]: `[len]` u16 at this address, valid while the
    /// guard lives (the guard borrows it).
    Lent(*const u16),
}

impl Region {
    fn bits(&self) -> &[u16] {
        match &self.copy {
            Copy16::Owned(v) => v,
            // SAFETY: `share_kept` registered `len` elements of a slice that its guard borrows,
            // and the region is popped when that guard drops.
            Copy16::Lent(p) => unsafe { std::slice::from_raw_parts(*p, self.len) },
        }
    }
}

thread_local! {
    /// The regions shared on this thread, innermost last.
    static REGIONS: RefCell<Vec<Region>> = const { RefCell::new(Vec::new()) };
    /// Buffers of dropped regions, kept for the next [`share`] (no allocation per step once
    /// they have grown).
    static SPARE: RefCell<Vec<Vec<u16>>> = const { RefCell::new(Vec::new()) };
}

#[cfg(test)]
thread_local! {
    /// Set by [`keeping_nothing`]: [`keep`] then keeps nothing, so every GEMM rounds its own
    /// operands, as before copies were kept.
    static KEEP_NOTHING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with [`keep`] keeping nothing on this thread: the reference the kept copies must
/// reproduce bit for bit (`super::bf16_kept_tests`).
#[cfg(test)]
pub(crate) fn keeping_nothing<R>(f: impl FnOnce() -> R) -> R {
    KEEP_NOTHING.set(true);
    let r = f();
    KEEP_NOTHING.set(false);
    r
}

/// While alive, native bf16 GEMMs on this thread read operands inside the shared slice from
/// its bf16 copy. Dropping it forgets the copy (its buffer is kept for reuse).
#[must_use = "the copy is used only while the guard lives"]
pub(crate) struct Shared<'a> {
    /// Whether a region was pushed (false off the native route: nothing to undo).
    pushed: bool,
    /// Keeps the shared slice (and a lent copy) borrowed, hence unchanged, while in use.
    _slice: PhantomData<&'a [f32]>,
}

impl Drop for Shared<'_> {
    fn drop(&mut self) {
        if !self.pushed {
            return;
        }
        let region = REGIONS.with(|r| r.borrow_mut().pop());
        if let Some(Region {
            copy: Copy16::Owned(copy),
            ..
        }) = region
        {
            SPARE.with(|s| s.borrow_mut().push(copy));
        }
    }
}

/// Rounds `x` to bf16 once for the native GEMMs that will read it while the returned guard
/// lives. Does nothing (a guard with nothing to undo) unless `A` is f32 and this thread's
/// GEMMs run natively in bf16 (`super::bf16::current`, `super::bf16::support`).
pub(crate) fn share<A: 'static>(x: &[A]) -> Shared<'_> {
    let Some(x) = native_f32(x) else {
        return Shared::none();
    };
    let mut copy = SPARE.with(|s| s.borrow_mut().pop()).unwrap_or_default();
    copy.clear();
    super::bf16::extend_bits(&mut copy, x);
    push(x, Copy16::Owned(copy))
}

/// Rounds `x` `[len]` to bf16 into `copy` (cleared first) for GEMMs of later scopes to read
/// through [`share_kept`]; leaves `copy` empty unless `A` is f32 and this thread's GEMMs run
/// natively in bf16 (as [`share`]).
pub(crate) fn keep<A: 'static>(x: &[A], copy: &mut Vec<u16>) {
    copy.clear();
    #[cfg(test)]
    if KEEP_NOTHING.get() {
        return;
    }
    super::bf16::native_copy(x, copy);
}

/// [`keep`] then [`share_kept`]: rounds `x` into `copy` and lends it to the GEMMs of this
/// scope, leaving it in `copy` for a later scope's [`share_kept`].
pub(crate) fn keep_and_share<'a, A: 'static>(x: &'a [A], copy: &'a mut Vec<u16>) -> Shared<'a> {
    keep(x, copy);
    share_kept(x, copy)
}

/// As [`share`], with the bf16 copy of `x` that [`keep`] wrote into `copy` from the same
/// values (the caller's promise: `x` has not changed since). An empty `copy` (nothing kept:
/// not the native route) shares nothing.
///
/// Panics if `copy` is neither empty nor `x.len()` long (a caller's bug).
pub(crate) fn share_kept<'a, A: 'static>(x: &'a [A], copy: &'a [u16]) -> Shared<'a> {
    if copy.is_empty() {
        return Shared::none();
    }
    assert_eq!(copy.len(), x.len(), "a kept bf16 copy covers its slice");
    let Some(x) = native_f32(x) else {
        return Shared::none();
    };
    push(x, Copy16::Lent(copy.as_ptr()))
}

/// `x` as f32 when `A` is f32, `x` is not empty and this thread's GEMMs run natively in bf16.
fn native_f32<A: 'static>(x: &[A]) -> Option<&[f32]> {
    if TypeId::of::<A>() != TypeId::of::<f32>()
        || super::bf16::current() != Precision::Bf16
        || !super::bf16::support().native
        || x.is_empty()
    {
        return None;
    }
    // SAFETY: `A` is f32 (checked above): same size, alignment and validity.
    Some(unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<f32>(), x.len()) })
}

/// Registers `copy` as the bf16 bits of `x` until the returned guard drops.
fn push<'a>(x: &'a [f32], copy: Copy16) -> Shared<'a> {
    REGIONS.with(|r| {
        r.borrow_mut().push(Region {
            start: x.as_ptr() as usize,
            len: x.len(),
            copy,
        })
    });
    Shared {
        pushed: true,
        _slice: PhantomData,
    }
}

impl Shared<'_> {
    /// A guard with nothing to undo.
    fn none() -> Self {
        Shared {
            pushed: false,
            _slice: PhantomData,
        }
    }
}

/// Calls `f` with `v`'s bf16 bit patterns read from a shared copy, when `v` (any strides
/// `>= 0`) lies wholly inside a region shared on this thread; else with `None`.
pub(crate) fn with_view<R>(
    v: &ArrayView2<'_, f32>,
    f: impl FnOnce(Option<ArrayView2<'_, u16>>) -> R,
) -> R {
    REGIONS.with(|r| {
        let regions = r.borrow();
        let view = regions.iter().rev().find_map(|region| view_in(region, v));
        f(view)
    })
}

/// `v` as a view of `region.copy`, when every element of `v` lies inside the region.
fn view_in<'r>(region: &'r Region, v: &ArrayView2<'_, f32>) -> Option<ArrayView2<'r, u16>> {
    let (rows, cols) = v.dim();
    let [rs, cs] = [v.strides()[0], v.strides()[1]];
    if rows == 0 || cols == 0 || rs < 0 || cs < 0 {
        return None;
    }
    let (rs, cs) = (rs as usize, cs as usize);
    let addr = v.as_ptr() as usize;
    let bytes = addr.checked_sub(region.start)?;
    if !bytes.is_multiple_of(size_of::<f32>()) {
        return None;
    }
    let first = bytes / size_of::<f32>();
    let last = first + (rows - 1) * rs + (cols - 1) * cs;
    if last >= region.len {
        return None;
    }
    ArrayView2::from_shape((rows, cols).strides((rs, cs)), &region.bits()[first..]).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::bf16::{bf16_bits, with_precision};
    use crate::model::gemm::{gemm, mat, mat_mut};
    use ndarray::{Array2, s};

    /// A region made by hand, as [`share`] makes it on the native route.
    fn region_of(x: &[f32]) -> Region {
        let mut copy = Vec::new();
        crate::model::bf16::extend_bits(&mut copy, x);
        Region {
            start: x.as_ptr() as usize,
            len: x.len(),
            copy: Copy16::Owned(copy),
        }
    }

    /// A view inside a shared slice reads the same bits as converting it, in every layout the
    /// model hands a GEMM; a view reaching outside it reads nothing. Runs on every machine.
    #[test]
    fn views_inside_a_region_read_its_rounded_copy() {
        let m = Array2::from_shape_fn((6, 10), |(i, j)| (i * 10 + j) as f32 * 0.731 - 7.0);
        let flat = m.as_slice().expect("standard layout");
        let region = region_of(&flat[10..]);
        let inner = m.slice(s![1.., ..]);
        for (what, v) in [
            ("rows 1..", inner),
            ("their transpose", inner.t()),
            ("rows 2..5", m.slice(s![2..5, ..])),
            ("row-strided columns", m.slice(s![1.., 3..7])),
            ("their transpose", m.slice(s![1.., 3..7]).reversed_axes()),
        ] {
            let got = view_in(&region, &v).unwrap_or_else(|| panic!("{what}: inside"));
            assert_eq!(got.dim(), v.dim(), "{what}");
            for (g, &x) in got.iter().zip(v.iter()) {
                assert_eq!(*g, bf16_bits(x), "{what}");
            }
        }
        for (what, v) in [
            ("starts before", m.view()),
            ("ends after", m.slice(s![.., 0..1])),
        ] {
            assert!(view_in(&region, &v).is_none(), "{what}");
        }
        let other = Array2::from_elem((2, 2), 1.5f32);
        assert!(view_in(&region, &other.view()).is_none(), "elsewhere");
    }

    /// A GEMM reading shared operands gives the same bits as one rounding them itself (`W^T`
    /// and `dy^T` included), and the guard's end forgets the copy. Where bf16 is not native,
    /// nothing is shared and both runs take the same route.
    #[test]
    fn shared_operands_give_the_same_bits() {
        let (n, i, o) = (48, 40, 24);
        let x: Vec<f32> = (0..n * i).map(|k| (k as f32 * 0.377).sin()).collect();
        let w: Vec<f32> = (0..o * i).map(|k| (k as f32 * 0.211).cos() * 0.3).collect();
        let dy: Vec<f32> = (0..n * o).map(|k| (k as f32 * 0.913).sin() * 0.1).collect();
        let run = |share_them: bool| {
            with_precision(Precision::Bf16, || {
                let _guards = share_them.then(|| (share(&w), share(&dy)));
                let mut y = vec![0f32; n * o];
                let mut dw = vec![0f32; o * i];
                let wm = mat(&w, o, i);
                gemm(
                    1.0,
                    &mat(&x, n, i),
                    &wm.t(),
                    0.0,
                    &mut mat_mut(&mut y, n, o),
                );
                gemm(
                    1.0,
                    &mat(&dy, n, o).t(),
                    &mat(&x, n, i),
                    0.0,
                    &mut mat_mut(&mut dw, o, i),
                );
                (y, dw)
            })
        };
        if !crate::model::bf16::support().native {
            eprintln!(
                "no native bf16 in this process ({}): nothing is shared, both runs emulate",
                crate::model::bf16::support().detail
            );
        }
        let (plain, shared) = (run(false), run(true));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&plain.0), bits(&shared.0), "y = x W^T");
        assert_eq!(bits(&plain.1), bits(&shared.1), "dW = dy^T x");
        assert!(REGIONS.with(|r| r.borrow().is_empty()), "guards popped");
        with_precision(Precision::Bf16, || {
            let guard = share(&w);
            assert_eq!(guard.pushed, crate::model::bf16::support().native);
        });
    }

    /// Off the bf16 precision nothing is shared.
    #[test]
    fn fp32_shares_nothing() {
        let x = vec![1.0f32; 8];
        let guard = share(&x);
        assert!(!guard.pushed);
        let m = ArrayView2::from_shape((2, 4), &x[..]).expect("fits");
        with_view(&m, |v| assert!(v.is_none()));
    }
}
