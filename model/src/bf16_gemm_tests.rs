//! Every GEMM form the model uses, in bf16 precision through the one entry point
//! (`super::gemm::gemm`), against an fp64 product of the same bf16-rounded inputs.
//!
//! Tolerance: with both inputs bf16, each product is exact in f32 and only the fp32
//! accumulation rounds: `|c - ref| <= gamma_k * (|alpha| sum_k |a_ik b_kj| + |beta c_ij|)` with
//! `gamma_k ~ (k + 2) * 2^-24` (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd
//! ed., eq. 3.5; +2 for alpha and beta). Each case also checks that the result is NOT the
//! unrounded fp64 product within that tolerance, so a path that skipped the rounding fails.

use keel_proto::precision::Precision;
use ndarray::{Array2, ArrayView2, s};

use super::bf16::round_bf16_f32;
use super::gemm::{GemmSite, Gemms, gemm, stats};

/// bf16 GEMMs over f32 on this process's route (native or emulated).
fn bf16() -> Gemms {
    Gemms::new::<f32>(Precision::Bf16)
}

/// One bf16 product cut among `parts` threads, as the model's entry points run it.
fn bf16_gemm(
    alpha: f32,
    a: &ArrayView2<'_, f32>,
    b: &ArrayView2<'_, f32>,
    beta: f32,
    c: &mut ndarray::ArrayViewMut2<'_, f32>,
    parts: usize,
) {
    super::gemm::block(bf16(), alpha, (*a).into(), (*b).into(), beta, c, parts);
}

/// Values with all 24 significant bits in use, in [-1.5, 1.5].
fn data(r: usize, c: usize, seed: u32) -> Array2<f32> {
    Array2::from_shape_fn((r, c), |(i, j)| {
        let x = (i as f32 * 12.9898 + j as f32 * 78.233 + seed as f32 * 37.719).sin() * 43_758.547;
        (x - x.floor()) * 3.0 - 1.5
    })
}

/// `alpha * a b + beta * c0` in fp64 with `a`, `b` rounded to bf16 (`round`) or not, and the
/// per-element bound scale `|alpha| sum |a||b| + |beta c0|`.
fn reference(
    alpha: f32,
    a: &ArrayView2<'_, f32>,
    b: &ArrayView2<'_, f32>,
    beta: f32,
    c0: &ArrayView2<'_, f32>,
    round: bool,
) -> (Array2<f64>, Array2<f64>) {
    let f = |x: f32| f64::from(if round { round_bf16_f32(x) } else { x });
    let a64 = a.mapv(f);
    let b64 = b.mapv(f);
    let value = a64.dot(&b64) * f64::from(alpha) + c0.mapv(f64::from) * f64::from(beta);
    let scale = a64.mapv(f64::abs).dot(&b64.mapv(f64::abs)) * f64::from(alpha).abs()
        + c0.mapv(|x| f64::from(x).abs()) * f64::from(beta).abs();
    (value, scale)
}

/// Runs `c = alpha a b + beta c` in bf16 (and checks it), `a`, `b`, `c` as views the model
/// passes (transposed, row-strided); returns the case's worst error in units of the bound.
fn check(
    name: &str,
    alpha: f32,
    a: ArrayView2<'_, f32>,
    b: ArrayView2<'_, f32>,
    beta: f32,
    c: &mut ndarray::ArrayViewMut2<'_, f32>,
) -> f64 {
    let k = a.ncols();
    let c0 = c.to_owned();
    let (want, scale) = reference(alpha, &a, &b, beta, &c0.view(), true);
    let (unrounded, _) = reference(alpha, &a, &b, beta, &c0.view(), false);
    let bf16_flops = || -> u64 { stats().class_flops.iter().map(|c| c[1] + c[2]).sum() };
    let before = bf16_flops();
    gemm(bf16(), GemmSite::Other, alpha, a.into(), b.into(), beta, c);
    // Counted as bf16 flops (other tests in this process may add theirs, never take away).
    assert!(
        bf16_flops() - before >= (2 * a.nrows() * k * b.ncols()) as u64,
        "{name}: stats"
    );
    let gamma = (k as f64 + 2.0) * 2f64.powi(-24);
    let mut worst: f64 = 0.0;
    let mut off_unrounded: f64 = 0.0;
    for ((got, w), (sc, u)) in c.iter().zip(&want).zip(scale.iter().zip(&unrounded)) {
        let bound = gamma * sc + f64::MIN_POSITIVE;
        worst = worst.max((f64::from(*got) - w).abs() / bound);
        off_unrounded = off_unrounded.max((f64::from(*got) - u).abs() / bound);
    }
    assert!(
        worst <= 1.0,
        "{name}: error {worst:.3} of the fp32-accumulation bound"
    );
    assert!(
        off_unrounded > 1.0,
        "{name}: result matches the unrounded product ({off_unrounded:.3}): no bf16 rounding"
    );
    worst
}

/// The model's GEMMs at tiny's shapes (`c = 128`, `f = 512`, `d = 64`, `t = 128`), with a
/// smaller `n` and vocabulary to keep the fp64 reference quick.
#[test]
fn every_model_gemm_form_matches_fp64_of_rounded_inputs() {
    // Native (oneDNN) where this CPU takes that route, emulated elsewhere: both must pass.
    println!(
        "bf16 route: {:?} ({})",
        super::bf16::backend(),
        super::bf16::support().detail
    );
    let (n, c, f, t, d, v, m) = (256, 128, 512, 128, 64, 1000, 40);
    // Linear forward x W^T + b (projections, FFN in and out, MLM transform, pooler).
    for (i, o) in [(c, 3 * c), (c, f), (f, c)] {
        let x = data(n, i, 1);
        let w = data(o, i, 2);
        let mut y = data(n, o, 3);
        check(
            "linear forward",
            1.0,
            x.view(),
            w.t(),
            1.0,
            &mut y.view_mut(),
        );
        // Weight gradient dW += dy^T x, and input gradient dx = dy W (and dx += dy W).
        let dy = data(n, o, 4);
        let mut dw = data(o, i, 5);
        check("linear dW", 1.0, dy.t(), x.view(), 1.0, &mut dw.view_mut());
        let mut dx = data(n, i, 6);
        check(
            "linear dx",
            1.0,
            dy.view(),
            w.view(),
            0.0,
            &mut dx.view_mut(),
        );
        check(
            "linear dx +=",
            1.0,
            dy.view(),
            w.view(),
            1.0,
            &mut dx.view_mut(),
        );
    }
    // Attention on one head: q, k, v are row-strided column blocks of the fused [t, 3c].
    let qkv = data(t, 3 * c, 7);
    let (q, k, vh) = (
        qkv.slice(s![.., 0..d]),
        qkv.slice(s![.., c..c + d]),
        qkv.slice(s![.., 2 * c..2 * c + d]),
    );
    let scale = 1.0 / (d as f32).sqrt();
    let mut scores = data(t, t, 8);
    check(
        "attention Q K^T",
        scale,
        q,
        k.t(),
        0.0,
        &mut scores.view_mut(),
    );
    let p = data(t, t, 9);
    let mut ctx = data(t, c, 10);
    check(
        "attention P V",
        1.0,
        p.view(),
        vh,
        0.0,
        &mut ctx.slice_mut(s![.., 0..d]),
    );
    let dctx = data(t, c, 11);
    let dctx_h = dctx.slice(s![.., 0..d]);
    let mut dp = data(t, t, 12);
    check(
        "attention dP = dO V^T",
        1.0,
        dctx_h,
        vh.t(),
        0.0,
        &mut dp.view_mut(),
    );
    let mut dqkv = data(t, 3 * c, 13);
    check(
        "attention dV = P^T dO",
        1.0,
        p.t(),
        dctx_h,
        0.0,
        &mut dqkv.slice_mut(s![.., 2 * c..2 * c + d]),
    );
    check(
        "attention dQ = dS K",
        scale,
        dp.view(),
        k,
        0.0,
        &mut dqkv.slice_mut(s![.., 0..d]),
    );
    check(
        "attention dK = dS^T Q",
        scale,
        dp.t(),
        q,
        0.0,
        &mut dqkv.slice_mut(s![.., c..c + d]),
    );
    // MLM decoder h E^T (tied embeddings), its weight gradient and input gradient.
    let h = data(m, c, 14);
    let e = data(v, c, 15);
    let mut logits = data(m, v, 16);
    check(
        "decoder h E^T",
        1.0,
        h.view(),
        e.t(),
        0.0,
        &mut logits.view_mut(),
    );
    let dl = data(m, v, 17);
    let mut de = data(v, c, 18);
    check(
        "decoder dE += dL^T h",
        1.0,
        dl.t(),
        h.view(),
        1.0,
        &mut de.view_mut(),
    );
    let mut dh = data(m, c, 19);
    check(
        "decoder dh = dL E",
        1.0,
        dl.view(),
        e.view(),
        0.0,
        &mut dh.view_mut(),
    );
    no_reference_kernel("every model GEMM form");
}

/// On the native route, no GEMM (nor part of one) may have run on a oneDNN reference kernel.
fn no_reference_kernel(what: &str) {
    if super::bf16::backend() == super::bf16::Bf16Backend::Native {
        assert_eq!(
            super::bf16::reference_kernel_calls(),
            0,
            "{what}: oneDNN ran a bf16 GEMM on a reference kernel"
        );
    }
}

/// Cut among threads (by rows, and by columns for a wide output), the bf16 GEMM gives the same
/// result within the same bound.
#[test]
fn bf16_gemm_cut_among_threads_matches() {
    for (m, k, n) in [(300, 128, 64), (40, 128, 700)] {
        let a = data(m, k, 20);
        let b = data(n, k, 21);
        let mut one = data(m, n, 22);
        let mut cut = one.clone();
        bf16_gemm(1.0, &a.view(), &b.t(), 0.5, &mut one.view_mut(), 1);
        bf16_gemm(1.0, &a.view(), &b.t(), 0.5, &mut cut.view_mut(), 3);
        let (want, scale) = reference(1.0, &a.view(), &b.t(), 0.5, &data(m, n, 22).view(), true);
        let gamma = (k as f64 + 2.0) * 2f64.powi(-24);
        for (x, (w, sc)) in cut
            .iter()
            .chain(one.iter())
            .zip(want.iter().chain(&want).zip(scale.iter().chain(&scale)))
        {
            assert!(
                (f64::from(*x) - w).abs() <= gamma * sc,
                "{m}x{k}x{n}: {x} vs {w}"
            );
        }
    }
    no_reference_kernel("cut among threads");
}

/// The bias added by oneDNN (`super::gemm::gemm_bias` on the native route), whole or cut among
/// threads by rows and, for a wide output (the MLM decoder's `[masked, vocab]`), by columns,
/// each part taking its own columns of the bias: the bits of the same product without a bias,
/// cut the same way, with the bias then added in f32 (the bias joins the finished sum once,
/// whichever kernel oneDNN picked for a part). The older route, the output filled with the bias
/// rows and the product added (`beta = 1`), sums in another order on some kernels (oneDNN's
/// `gemm:jit`, which runs a column part's strided output on an AMX CPU), so it is held only to
/// twice the accumulation bound of the module doc, with the bias in the scale. `k` goes up to
/// 4,096 (oneDNN sums long `k` in chunks). Then `gemm_bias` itself, the entry point the model
/// calls, counted once as bf16 flops: on the native route the product plus the bias, elsewhere
/// the fill route (it is that route). Off the native route (no bf16 hardware) the first half
/// says so and is skipped, and `onednn::tests` checks the column parts in f32.
#[test]
fn bias_added_by_the_gemm_is_the_product_plus_the_bias() {
    for (m, k, n) in [
        (300, 128, 64),
        (40, 128, 700),
        (37, 130, 61),
        (128, 4096, 96),
    ] {
        let a = data(m, k, 30);
        let b = data(n, k, 31);
        let bias: Vec<f32> = data(1, n, 32).iter().map(|x| x * 4.0).collect();
        let filled = || {
            let mut c = Array2::<f32>::zeros((m, n));
            for mut row in c.rows_mut() {
                row.assign(&ndarray::aview1(&bias));
            }
            c
        };
        let (_, scale) = reference(1.0, &a.view(), &b.t(), 0.0, &filled().view(), true);
        let gamma = 2.0 * (k as f64 + 2.0) * 2f64.powi(-24);
        let check = |got: &Array2<f32>, exact: &Array2<f32>, fill: &Array2<f32>, what: &str| {
            let differ = got
                .iter()
                .zip(exact.iter())
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            assert_eq!(differ, 0, "{m}x{k}x{n} {what}: {differ} elements differ");
            for ((i, j), &x) in got.indexed_iter() {
                let bound = gamma * (f64::from(bias[j]).abs() + scale[(i, j)]);
                let d = (f64::from(x) - f64::from(fill[(i, j)])).abs();
                assert!(
                    d <= bound,
                    "{m}x{k}x{n} {what} [{i}, {j}]: {x} against the fill route's {}: {d:e} \
                     over {bound:e}",
                    fill[(i, j)]
                );
            }
            let mut plain = Array2::<f32>::zeros((m, n));
            bf16_gemm(1.0, &a.view(), &b.t(), 0.0, &mut plain.view_mut(), 1);
            let moved = plain.iter().zip(got.iter()).filter(|(x, y)| x != y).count();
            assert!(
                moved > m * n / 2,
                "{m}x{k}x{n} {what}: the bias changed {moved} elements"
            );
        };
        let plus_bias = |mut c: Array2<f32>| {
            for mut row in c.rows_mut() {
                for (x, z) in row.iter_mut().zip(&bias) {
                    *x += z;
                }
            }
            c
        };
        for parts in [1, 3] {
            let mut fill = filled();
            bf16_gemm(1.0, &a.view(), &b.t(), 1.0, &mut fill.view_mut(), parts);
            let mut plain = Array2::<f32>::zeros((m, n));
            bf16_gemm(1.0, &a.view(), &b.t(), 0.0, &mut plain.view_mut(), parts);
            let mut got = Array2::<f32>::from_elem((m, n), f32::NAN);
            if super::bf16::support().native {
                super::bf16::native_gemm_f32(
                    1.0,
                    (Some(&a.view()), None),
                    (Some(&b.t()), None),
                    Some(&bias),
                    0.0,
                    &mut got.view_mut(),
                    parts,
                );
                check(
                    &got,
                    &plus_bias(plain),
                    &fill,
                    &format!("native, {parts} parts"),
                );
            } else {
                println!("SKIPPED (native route, {parts} parts): no native bf16 GEMM on this CPU");
            }
        }
        let mut fill = filled();
        let other = GemmSite::Other;
        gemm(
            bf16(),
            other,
            1.0,
            a.view().into(),
            b.t().into(),
            1.0,
            &mut fill.view_mut(),
        );
        let mut plain = Array2::<f32>::zeros((m, n));
        gemm(
            bf16(),
            other,
            1.0,
            a.view().into(),
            b.t().into(),
            0.0,
            &mut plain.view_mut(),
        );
        let mut got = Array2::<f32>::from_elem((m, n), f32::NAN);
        let bf16_flops = || -> u64 { stats().class_flops.iter().map(|c| c[1] + c[2]).sum() };
        let before = bf16_flops();
        let (a_op, b_op) = (a.view().into(), b.t().into());
        super::gemm::gemm_bias(bf16(), other, a_op, b_op, &bias, &mut got.view_mut());
        assert!(
            bf16_flops() >= before + (2 * m * n * k) as u64,
            "{m}x{k}x{n}: gemm_bias not counted as bf16 flops"
        );
        let exact = if super::bf16::support().native {
            plus_bias(plain)
        } else {
            fill.clone()
        };
        check(&got, &exact, &fill, "gemm_bias");
    }
    no_reference_kernel("bias added by the GEMM");
}
