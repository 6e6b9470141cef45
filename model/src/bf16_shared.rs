//! GEMM operands that carry their bf16 copy, so that one rounding serves several native GEMMs.
//!
//! Without copies, the native route (`super::bf16::native_gemm_f32`) rounds both operands of
//! every call: a weight once in forward and again for its input gradient, a layer's input
//! once for each of the query, key and value projections in forward and again for each of
//! their weight gradients, an output gradient `dy` once for the weight gradient and again for
//! the input gradient. Here the rounding is made once, into a buffer its caller owns, and
//! handed to each GEMM that reads the same values as part of the operand ([`Operand`],
//! [`Flat`]): the model's parameters once per micro-batch (a buffer `super::Bert` owns), a
//! layer's inputs by its forward for its backward ([`keep`], into the layer's cache), a `dy`
//! for both of its Linear's GEMMs ([`round_once`]).
//!
//! A copy is the same rounding of the same numbers the GEMM would make itself, and it is read
//! with the operand's own shape and strides (so `W` and `W^T` are both served by one copy of
//! `W`): results are bit-identical with or without it; only the passes over memory change.
//! Copies exist only on the native route ([`Gemms::native`]); elsewhere every `bf16` is `None`.
//!
//! Where an activation is read in the backward only by GEMMs (a Linear's input for its weight
//! gradient, attention's `q`, `k`, `v`), a layer keeping copies stores only the copy
//! ([`Flat::copy_only`]): its operand then has no f32 values (`Operand::f32` is `None`), which
//! only the native route, reading the copy, accepts.

use ndarray::{ArrayView2, ShapeBuilder};

use super::Element;
use super::element::{f32_slice, f32_slice_mut};
use super::gemms::Gemms;

/// One input of a GEMM: its values and, on the native bf16 route, optionally the bf16 bit
/// patterns of exactly those values with the same shape and strides (`[rows, cols]` both).
/// At least one of the two is there; the values may be left out only where the copy is given
/// (an activation kept as its copy alone, read by native GEMMs only).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operand<'a, A> {
    /// The values (f32 or f64), any strides; `None` when only the copy was kept.
    pub f32: Option<ArrayView2<'a, A>>,
    /// Their bf16 copy, element `[i, j]` the rounding of `f32[[i, j]]`; `None`: the GEMM
    /// rounds them itself when it needs bf16.
    pub bf16: Option<ArrayView2<'a, u16>>,
}

impl<'a, A> Operand<'a, A> {
    /// An operand without a copy.
    pub(crate) fn plain(f32: ArrayView2<'a, A>) -> Operand<'a, A> {
        Operand {
            f32: Some(f32),
            bf16: None,
        }
    }

    /// The transposed operand (its copy transposed with it).
    pub(crate) fn t(self) -> Operand<'a, A> {
        Operand {
            f32: self.f32.map(|v| v.reversed_axes()),
            bf16: self.bf16.map(|v| v.reversed_axes()),
        }
    }

    /// `[rows, cols]`, from the values or, without them, from the copy.
    pub(crate) fn dim(&self) -> (usize, usize) {
        match (&self.f32, &self.bf16) {
            (Some(v), _) => v.dim(),
            (None, Some(c)) => c.dim(),
            (None, None) => unreachable!("an operand has its values or its copy"),
        }
    }

    /// The values, for a route that reads them (fp32, emulated bf16).
    ///
    /// Panics if only the copy was kept: such operands are made only where the GEMMs run
    /// natively ([`Gemms::keeps`]), so this is a caller's bug.
    pub(crate) fn values(&self) -> &ArrayView2<'a, A> {
        self.f32
            .as_ref()
            .expect("an operand kept as its bf16 copy alone reaches only native bf16 GEMMs")
    }
}

impl<'a, A> From<ArrayView2<'a, A>> for Operand<'a, A> {
    fn from(f32: ArrayView2<'a, A>) -> Operand<'a, A> {
        Operand::plain(f32)
    }
}

/// A flat buffer (the parameters, a layer's activation) and, optionally, its bf16 copy element
/// for element: where GEMM operands are cut from ([`Flat::mat`]). An activation kept as its
/// copy alone ([`Flat::copy_only`]) has empty values.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Flat<'a, A> {
    /// The values (empty when only the copy was kept).
    pub f32: &'a [A],
    /// `[f32.len()]` bf16 bit patterns of `f32` (or of the values no longer kept), or `None`.
    pub bf16: Option<&'a [u16]>,
}

impl<'a, A> Flat<'a, A> {
    /// A buffer without a copy.
    pub(crate) fn plain(f32: &'a [A]) -> Flat<'a, A> {
        Flat { f32, bf16: None }
    }

    /// `x` with the copy [`keep`] (or [`round_once`]) made of it, from the same values (the
    /// caller's promise: `x` has not changed since). An empty `copy` (nothing kept: not the
    /// native route) is no copy.
    ///
    /// Panics if `copy` is neither empty nor as long as `x` (a caller's bug).
    pub(crate) fn kept(x: &'a [A], copy: &'a [u16]) -> Flat<'a, A> {
        if copy.is_empty() {
            return Flat::plain(x);
        }
        assert_eq!(copy.len(), x.len(), "a kept bf16 copy covers its slice");
        Flat {
            f32: x,
            bf16: Some(copy),
        }
    }

    /// The bf16 copy of an activation whose f32 values were not kept (the caller's promise:
    /// only native bf16 GEMMs read it, [`Gemms::keeps`]). An empty `copy` is an empty operand
    /// (no rows).
    pub(crate) fn copy_only(copy: &'a [u16]) -> Flat<'a, A> {
        Flat {
            f32: &[],
            bf16: Some(copy),
        }
    }

    /// The first `len` elements of an activation a layer's forward kept for GEMMs alone, as
    /// its backward reads them: the copy alone where `gemms` keeps copies (the forward then
    /// kept no f32 values: `f32` is not read and may be empty), else the values (`copy` is
    /// then empty).
    ///
    /// Panics if the buffer read is shorter than `len` (a caller's bug).
    pub(crate) fn activation(
        gemms: Gemms,
        f32: &'a [A],
        copy: &'a [u16],
        len: usize,
    ) -> Flat<'a, A> {
        if gemms.keeps() {
            Flat::copy_only(&copy[..len])
        } else {
            Flat::plain(&f32[..len])
        }
    }

    /// `[rows, cols]` row-major from element `at`, as a GEMM operand (with the copy's view;
    /// the copy's view alone for [`Flat::copy_only`]).
    ///
    /// Panics if the buffer (or, for a copy alone, the copy) is shorter than
    /// `at + rows * cols` (a caller's bug).
    pub(crate) fn mat(self, at: usize, rows: usize, cols: usize) -> Operand<'a, A> {
        fn view<T>(s: &[T], at: usize, rows: usize, cols: usize) -> ArrayView2<'_, T> {
            ArrayView2::from_shape((rows, cols).strides((cols, 1)), &s[at..at + rows * cols])
                .expect("rows * cols elements")
        }
        let copy_only = self.f32.is_empty() && self.bf16.is_some();
        Operand {
            f32: (!copy_only).then(|| view(self.f32, at, rows, cols)),
            bf16: self.bf16.map(|c| view(c, at, rows, cols)),
        }
    }
}

/// Rounds `x` to bf16 into `copy` (cleared first), for the GEMMs of a later pass to read
/// through [`Flat::kept`]; leaves `copy` empty unless `gemms` keeps copies (the native bf16
/// route on f32, [`Gemms::keeps`]).
pub(crate) fn keep<A: Element>(gemms: Gemms, x: &[A], copy: &mut Vec<u16>) {
    copy.clear();
    if gemms.keeps() {
        round_into(x, copy);
    }
}

/// `x` with its bf16 copy, rounded into `buf` once for the several native GEMMs about to read
/// it; `x` alone off the native route (or when empty).
pub(crate) fn round_once<'a, A: Element>(
    gemms: Gemms,
    x: &'a [A],
    buf: &'a mut Vec<u16>,
) -> Flat<'a, A> {
    buf.clear();
    if !gemms.native() || x.is_empty() {
        return Flat::plain(x);
    }
    round_into(x, buf);
    Flat::kept(x, buf)
}

/// `x` as the operand of the native GEMMs about to read it, rounded once in place
/// (`super::bf16_convert::round_in_place`: its f32 values are lost, the copy alone is left);
/// `x` as it is off the native route (or for f64). For a gradient whose f32 values nothing
/// reads after those GEMMs, so that no second buffer holds its copy.
pub(crate) fn round_in_place<'a, A: Element>(gemms: Gemms, x: &'a mut [A]) -> Flat<'a, A> {
    // Whether `A` is f32, asked of an empty slice (so that `x` is borrowed once).
    if !gemms.native() || f32_slice::<A>(&[]).is_none() {
        return Flat::plain(x);
    }
    let x32 = f32_slice_mut(x).expect("A is f32");
    Flat::copy_only(super::bf16_convert::round_in_place(x32))
}

/// Appends the bf16 bits of `x` to `out` when `A` is f32.
fn round_into<A: Element>(x: &[A], out: &mut Vec<u16>) {
    if let Some(x) = f32_slice(x) {
        super::bf16_convert::extend_bits(out, x);
    }
}

#[cfg(test)]
mod tests {
    use keel_proto::precision::Precision;
    use ndarray::{Array2, s};

    use super::*;
    use crate::bf16::{bf16_bits, support};
    use crate::gemm::{GemmSite, gemm, mat_mut};

    /// A copy cut from a [`Flat`] reads the same bits as rounding the view it goes with, in
    /// every layout the model hands a GEMM.
    #[test]
    fn a_flat_copy_reads_the_rounding_of_its_view() {
        let x: Vec<f32> = (0..60).map(|i| i as f32 * 0.731 - 7.0).collect();
        let mut copy = Vec::new();
        crate::bf16_convert::extend_bits(&mut copy, &x);
        let flat = Flat::kept(&x, &copy);
        let m = flat.mat(10, 5, 10);
        for (what, v) in [
            ("rows", m),
            ("their transpose", m.t()),
            ("a block of columns", {
                let Operand { f32, bf16 } = m;
                Operand {
                    f32: f32.map(|f| f.slice_move(s![.., 3..7])),
                    bf16: bf16.map(|b| b.slice_move(s![.., 3..7])),
                }
            }),
        ] {
            let bits = v.bf16.expect("a copy");
            assert_eq!(bits.dim(), v.dim(), "{what}");
            for (g, &x) in bits.iter().zip(v.values().iter()) {
                assert_eq!(*g, bf16_bits(x), "{what}");
            }
        }
        assert!(Flat::kept(&x, &[]).bf16.is_none(), "nothing kept");
    }

    /// GEMMs given the bf16 copies of their operands (`W^T`, `dy^T` views of them) give the
    /// same bits as GEMMs rounding them themselves. Where bf16 is not native, no copy is made
    /// and both runs take the same route.
    #[test]
    fn operands_with_copies_give_the_same_bits() {
        let (n, i, o) = (48, 40, 24);
        let x: Vec<f32> = (0..n * i).map(|k| (k as f32 * 0.377).sin()).collect();
        let w: Vec<f32> = (0..o * i).map(|k| (k as f32 * 0.211).cos() * 0.3).collect();
        let dy: Vec<f32> = (0..n * o).map(|k| (k as f32 * 0.913).sin() * 0.1).collect();
        let g = Gemms::new::<f32>(Precision::Bf16);
        let run = |with_copies: bool| {
            let (mut w16, mut dy16) = (Vec::new(), Vec::new());
            let (wf, dyf) = if with_copies {
                (round_once(g, &w, &mut w16), round_once(g, &dy, &mut dy16))
            } else {
                (Flat::plain(&w[..]), Flat::plain(&dy[..]))
            };
            assert_eq!(wf.bf16.is_some(), with_copies && g.native());
            let xf = Flat::plain(&x[..]);
            let mut y = vec![0f32; n * o];
            let mut dw = vec![0f32; o * i];
            let site = GemmSite::Other;
            gemm(
                g,
                site,
                1.0,
                xf.mat(0, n, i),
                wf.mat(0, o, i).t(),
                0.0,
                &mut mat_mut(&mut y, n, o),
            );
            gemm(
                g,
                site,
                1.0,
                dyf.mat(0, n, o).t(),
                xf.mat(0, n, i),
                0.0,
                &mut mat_mut(&mut dw, o, i),
            );
            (y, dw)
        };
        if !support().native {
            eprintln!(
                "no native bf16 in this process ({}): no copies, both runs emulate",
                support().detail
            );
        }
        let (plain, copied) = (run(false), run(true));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&plain.0), bits(&copied.0), "y = x W^T");
        assert_eq!(bits(&plain.1), bits(&copied.1), "dW = dy^T x");
    }

    /// A wrong copy is read: the GEMM takes the copy it is given, so the test above could fail.
    #[test]
    fn a_given_copy_is_what_the_native_gemm_reads() {
        let g = Gemms::new::<f32>(Precision::Bf16);
        if !g.native() {
            eprintln!("no native bf16 here: copies are never read");
            return;
        }
        let a = Array2::from_elem((4, 4), 1.0f32);
        let ones = Array2::from_elem((4, 4), bf16_bits(1.0));
        let twos = Array2::from_elem((4, 4), bf16_bits(2.0));
        let mut c = Array2::zeros((4, 4));
        let twos_op = Operand {
            f32: Some(a.view()),
            bf16: Some(twos.view()),
        };
        let ones_op = Operand {
            f32: Some(a.view()),
            bf16: Some(ones.view()),
        };
        gemm(
            g,
            GemmSite::Other,
            1.0,
            twos_op,
            ones_op,
            0.0,
            &mut c.view_mut(),
        );
        assert!(c.iter().all(|&v| v == 8.0), "{c}");
    }

    /// Off the native route nothing is kept or rounded.
    #[test]
    fn fp32_keeps_nothing() {
        let x = vec![1.0f32; 8];
        let mut copy = vec![7u16; 3];
        keep(Gemms::FP32, &x, &mut copy);
        assert!(copy.is_empty());
        assert!(round_once(Gemms::FP32, &x, &mut copy).bf16.is_none());
        assert!(
            round_once(Gemms::new::<f64>(Precision::Bf16), &[1.0f64], &mut copy)
                .bf16
                .is_none()
        );
    }
}
