//! Tests of `super` (oneDNN's matmul through the shim): every layout against fp64, the
//! cache, bf16 bits independent of addresses, and the bias.

use ndarray::{Array2, ShapeBuilder};

use super::{InputType, Key, matmul, primitive};
use crate::bf16::{bf16_bits, round_bf16_f32};

fn filled(r: usize, c: usize, seed: usize, column_major: bool) -> Array2<f32> {
    let f =
        move |(i, j): (usize, usize)| (((i * 131 + j * 71 + seed * 17) % 97) as f32 - 48.0) / 37.0;
    if column_major {
        Array2::from_shape_fn((r, c).f(), f)
    } else {
        Array2::from_shape_fn((r, c), f)
    }
}

/// How many elements of two same-shaped arrays differ in their bits.
fn differing_bits(a: &Array2<f32>, b: &Array2<f32>) -> usize {
    a.iter()
        .zip(b.iter())
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

fn reference(
    alpha: f64,
    a: &Array2<f32>,
    b: &Array2<f32>,
    beta: f64,
    c: &Array2<f32>,
) -> Array2<f64> {
    let a = a.mapv(f64::from);
    let b = b.mapv(f64::from);
    a.dot(&b) * alpha + c.mapv(f64::from) * beta
}

/// Largest `|x - ref|` over `sum_k |a_ik b_kj|`-scaled units: the fp32 accumulation bound
/// is `k * 2^-24` of that sum (Higham, "Accuracy and Stability", eq. 3.5).
fn worst_relative(got: &Array2<f32>, want: &Array2<f64>, scale: f64) -> f64 {
    got.iter()
        .zip(want.iter())
        .map(|(g, w)| (f64::from(*g) - w).abs() / scale)
        .fold(0.0, f64::max)
}

/// oneDNN's f32 matmul (works on every x86-64 CPU, AVX2 included) through the shim gives
/// the fp64 product within fp32 accumulation error, for all four transposes, a
/// row-strided output, alpha and beta, and the cache hands back the same primitive.
#[test]
fn f32_matmul_matches_fp64_for_every_layout() {
    for &(m, k, n) in &[(96, 64, 40), (7, 300, 90), (128, 128, 64), (33, 1, 65)] {
        for layout in 0..4 {
            let (ta, tb) = (layout & 1 == 1, layout & 2 == 2);
            let a = filled(m, k, 1, ta);
            let b = filled(k, n, 2, tb);
            let c0 = filled(m, n + 3, 3, false);
            let (alpha, beta) = (0.75f32, 0.5f32);
            let mut wide = c0.clone();
            let mut c = wide.slice_mut(ndarray::s![.., ..n]);
            let name = matmul(
                InputType::F32,
                (alpha, &a.view(), &b.view()),
                None,
                beta,
                &mut c,
            )
            .unwrap_or_else(|e| panic!("{m}x{k}x{n} layout {layout}: {e}"));
            assert!(!name.is_empty());
            let got = c.to_owned();
            let want = reference(
                f64::from(alpha),
                &a,
                &b,
                f64::from(beta),
                &c0.slice(ndarray::s![.., ..n]).to_owned(),
            );
            let scale = (k as f64) * (48.0 / 37.0f64).powi(2);
            let worst = worst_relative(&got, &want, scale);
            assert!(
                worst <= (k as f64 + 2.0) * 2f64.powi(-24),
                "{m}x{k}x{n} layout {layout}: error {worst:e} of the |a||b| sum"
            );
            // The columns past n were not touched.
            assert_eq!(
                wide.slice(ndarray::s![.., n..]),
                c0.slice(ndarray::s![.., n..])
            );
        }
    }
}

/// A second request for the same shape, strides, alpha and beta gets the cached primitive.
#[test]
fn primitives_are_cached_per_key() {
    let key = Key::plain(
        InputType::F32,
        [17, 9, 5],
        [9, 1, 1, 9, 5, 1],
        (1.0, 0.0),
        false,
    );
    let first = primitive(key).expect("oneDNN creates an f32 matmul on any x86-64 CPU");
    let again = primitive(key).expect("cached");
    assert!(std::sync::Arc::ptr_eq(&first, &again));
    let other = primitive(Key {
        beta: 1f32.to_bits(),
        ..key
    })
    .expect("beta = 1");
    assert!(!std::sync::Arc::ptr_eq(&first, &other));
    let biased = primitive(Key { bias: true, ..key }).expect("with a bias");
    assert!(!std::sync::Arc::ptr_eq(&first, &biased));
}

/// oneDNN's bf16 matmul, where this CPU has one (AVX512_BF16 or AMX; on AVX2 oneDNN 2.6
/// cannot create it, and the test says so and checks nothing more). The products of bf16
/// values are exact in f32, so the result is the fp64 product of the rounded inputs within
/// fp32 accumulation error.
#[test]
fn bf16_matmul_matches_fp64_of_rounded_inputs_where_supported() {
    let (m, k, n) = (64, 256, 48);
    let a = filled(m, k, 1, false).mapv(round_bf16_f32);
    let b = filled(k, n, 2, true).mapv(round_bf16_f32);
    let a16 = a.mapv(bf16_bits);
    let b16 = b.mapv(bf16_bits);
    let b16 = {
        let mut t = Array2::<u16>::zeros((k, n).f());
        t.assign(&b16);
        t
    };
    let mut c = Array2::<f32>::zeros((m, n));
    match matmul(
        InputType::Bf16,
        (1.0, &a16.view(), &b16.view()),
        None,
        0.0,
        &mut c.view_mut(),
    ) {
        Err(e) => {
            println!("SKIPPED: this CPU has no oneDNN bf16 matmul ({e})");
            return;
        }
        Ok(name) => println!("oneDNN bf16 implementation: {name}"),
    }
    let want = reference(1.0, &a, &b, 0.0, &Array2::zeros((m, n)));
    let scale = (k as f64) * (48.0 / 37.0f64).powi(2);
    let worst = worst_relative(&c, &want, scale);
    assert!(
        worst <= (k as f64 + 2.0) * 2f64.powi(-24),
        "error {worst:e}"
    );
}

/// Same inputs at different addresses (offset by 0..8 elements) and run twice: the bf16
/// result must be the same bits (determinism of recovery and of reruns depends on it).
#[test]
fn bf16_matmul_bits_do_not_depend_on_addresses_or_history() {
    for (m, k, n, beta) in [
        (512, 128, 512, 0.0f32),
        (4096, 128, 128, 1.0),
        (128, 4096, 128, 1.0),
        (37, 130, 61, 0.0),
    ] {
        let a = filled(m, k, 3, false).mapv(bf16_bits);
        let b = filled(k, n, 4, false).mapv(bf16_bits);
        let c0 = filled(m, n, 5, false);
        let mut first: Option<Array2<f32>> = None;
        for shift in 0..8usize {
            for _ in 0..2 {
                let mut abig = Array2::<u16>::zeros((m, k + 8));
                abig.slice_mut(ndarray::s![.., shift..shift + k]).assign(&a);
                let av = abig.slice(ndarray::s![.., shift..shift + k]);
                let mut bbig = Array2::<u16>::zeros((k, n + 8));
                bbig.slice_mut(ndarray::s![.., shift..shift + n]).assign(&b);
                let bv = bbig.slice(ndarray::s![.., shift..shift + n]);
                let mut cbig = Array2::<f32>::zeros((m, n + 8));
                cbig.slice_mut(ndarray::s![.., shift..shift + n])
                    .assign(&c0);
                let mut cv = cbig.slice_mut(ndarray::s![.., shift..shift + n]);
                if matmul(InputType::Bf16, (1.0, &av, &bv), None, beta, &mut cv).is_err() {
                    println!("SKIPPED: no oneDNN bf16 matmul here");
                    return;
                }
                let got = cv.to_owned();
                match &first {
                    None => first = Some(got),
                    Some(f) => {
                        let diff = differing_bits(f, &got);
                        assert_eq!(
                            diff, 0,
                            "[{m},{k}]x[{k},{n}] beta {beta} shift {shift}: {diff} elements differ"
                        );
                    }
                }
            }
        }
    }
}

/// The bias: `c = a b + bias` gives the bits of the product without a bias with the bias
/// then added in f32 (oneDNN adds it once, to the finished sum), in f32 on every CPU and in
/// bf16 where this CPU has it, whichever kernel oneDNN picks; for a plain and a transposed
/// `b`, a row-strided `c` (which oneDNN 2.6.3 on an AMX CPU runs on `gemm:jit`, not the AMX
/// kernel), and a width that is not a multiple of the kernels'.
///
/// The older route, `c` filled with the bias rows and `c = a b + 1 * c`, is not always the same
/// bits: `gemm:jit` folds `c` into the sum before its last `k` block, so the bias joins the
/// running sum early (1,215 of 64x48 elements differed on an AMX Xeon). Summed in another
/// order, the two may differ by twice the fp32 accumulation bound,
/// `2 (k + 2) 2^-24 (|bias| + sum_k |a_ik b_kj|)` (Higham, "Accuracy and Stability", eq. 3.5):
/// checked too.
#[test]
fn bias_gives_the_bits_of_the_product_plus_the_bias() {
    for input in [InputType::F32, InputType::Bf16] {
        for &(m, k, n, tb) in &[
            (64, 256, 48, false),
            (37, 130, 61, true),
            (128, 64, 300, true),
        ] {
            let a = filled(m, k, 6, false);
            let b = filled(k, n, 7, tb);
            let bias: Vec<f32> = (0..n).map(|j| (j as f32 - 20.0) / 9.0).collect();
            let mut filled_c = Array2::<f32>::zeros((m, n + 5));
            let mut biased_c = filled_c.clone();
            let mut plain = filled_c.clone();
            for mut row in filled_c.rows_mut() {
                row.slice_mut(ndarray::s![..n])
                    .assign(&ndarray::aview1(&bias));
            }
            let (a_in, b_in) = match input {
                InputType::F32 => (a.clone(), b.clone()),
                InputType::Bf16 => (a.mapv(round_bf16_f32), b.mapv(round_bf16_f32)),
            };
            let run = |bias: Option<&[f32]>, beta: f32, c: &mut Array2<f32>| {
                let mut cv = c.slice_mut(ndarray::s![.., ..n]);
                match input {
                    InputType::F32 => {
                        matmul(input, (1.0, &a.view(), &b.view()), bias, beta, &mut cv)
                    }
                    InputType::Bf16 => {
                        let (a16, b16) = (a.mapv(bf16_bits), b.mapv(bf16_bits));
                        matmul(input, (1.0, &a16.view(), &b16.view()), bias, beta, &mut cv)
                    }
                }
            };
            let kernel = match run(None, 0.0, &mut plain) {
                Ok(kernel) => kernel,
                Err(e) => {
                    assert_eq!(input, InputType::Bf16, "f32 matmul failed: {e}");
                    println!("SKIPPED (bf16): this CPU has no oneDNN bf16 matmul ({e})");
                    break;
                }
            };
            run(Some(&bias), 0.0, &mut biased_c)
                .unwrap_or_else(|e| panic!("{input:?} {m}x{k}x{n} with a bias: {e}"));
            run(None, 1.0, &mut filled_c).expect("the same matmul with beta = 1");
            let mut plus_bias = plain.clone();
            for mut row in plus_bias.rows_mut() {
                for (x, z) in row.iter_mut().zip(&bias) {
                    *x += z;
                }
            }
            let differ = differing_bits(&plus_bias, &biased_c);
            assert_eq!(
                differ, 0,
                "{input:?} {m}x{k}x{n} (b transposed: {tb}, kernel {kernel}): {differ} elements \
                 differ from the product plus the bias"
            );
            // The bias was really added: the columns past n stayed 0 and the rest moved.
            assert!(
                biased_c
                    .slice(ndarray::s![.., n..])
                    .iter()
                    .all(|&x| x == 0.0)
            );
            let moved = differing_bits(&plain, &biased_c);
            assert!(
                moved > m * n / 2,
                "{input:?} {m}x{k}x{n}: the bias changed only {moved} elements"
            );
            // The fill route: the same sum in another order.
            let scale = a_in
                .mapv(|x| f64::from(x).abs())
                .dot(&b_in.mapv(|x| f64::from(x).abs()));
            let gamma = 2.0 * (k as f64 + 2.0) * 2f64.powi(-24);
            for ((i, j), &x) in biased_c.slice(ndarray::s![.., ..n]).indexed_iter() {
                let bound = gamma * (f64::from(bias[j]).abs() + scale[(i, j)]);
                let d = (f64::from(x) - f64::from(filled_c[(i, j)])).abs();
                assert!(
                    d <= bound,
                    "{input:?} {m}x{k}x{n} ({kernel}) [{i}, {j}]: the bias route {x} and the \
                     fill route {} differ by {d:e}, over the bound {bound:e}",
                    filled_c[(i, j)]
                );
            }
        }
    }
}

/// `split_keeping_c_layout` tells each part its columns of `C`: with oneDNN's f32 matmul (every
/// CPU), a wide output cut into 3 column blocks, each adding its own columns of the bias,
/// gives the bits of the same cut with the output filled with the bias and `beta = 1`; a
/// tall output (cut by rows) gets the whole bias in every part.
#[test]
fn column_parts_take_their_own_columns_of_the_bias() {
    for (m, k, n) in [(40, 96, 700), (300, 96, 64)] {
        let a = filled(m, k, 8, false);
        let b = filled(k, n, 9, true);
        let bias: Vec<f32> = (0..n).map(|j| (j as f32 - 300.0) / 7.0).collect();
        let mut want = Array2::<f32>::zeros((m, n));
        for mut row in want.rows_mut() {
            row.assign(&ndarray::aview1(&bias));
        }
        let mut got = Array2::<f32>::from_elem((m, n), f32::NAN);
        let run = |c: &mut Array2<f32>, with_bias: bool| {
            crate::gemm_split::split_keeping_c_layout(
                &a.view(),
                &b.view(),
                &mut c.view_mut(),
                3,
                &|a, b, c, cols| {
                    assert_eq!(cols.len(), c.ncols());
                    let (z, beta) = if with_bias {
                        (Some(&bias[cols]), 0.0)
                    } else {
                        (None, 1.0)
                    };
                    matmul(InputType::F32, (1.0, a, b), z, beta, c).expect("f32 matmul");
                },
            )
        };
        run(&mut want, false);
        run(&mut got, true);
        let differ = differing_bits(&got, &want);
        assert_eq!(differ, 0, "{m}x{k}x{n}: {differ} elements differ");
    }
}
