//! Fully connected layer `y = x W^T + b` (HF: `nn.Linear` inside every BERT block).
//!
//! Shapes: `x` `[n, i]`, `W` `[o, i]` (PyTorch's layout), `b` `[o]`, `y` `[n, o]`.

use super::pass_profile::{Pass, bytes, region};
use keel_proto::params::LinearParams;

use super::Element;
use super::bf16_shared::{Flat, round_in_place};
use super::gemm::{GemmSite, gemm, gemm_bias, mat_mut};
use super::gemms::Gemms;
use super::parallel;

/// Where a Linear's weight and bias live in the flat buffer.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    /// Offset of `W` `[o, i]`.
    w: usize,
    /// Offset of `b` `[o]`.
    b: usize,
    /// Output features `o`.
    pub out: usize,
    /// Input features `i`.
    pub inp: usize,
    /// Which GEMM this Linear's are, for the stats.
    site: GemmSite,
}

impl Linear {
    /// The Linear over these tensors of the layout; its GEMMs count as `site`.
    pub fn new(params: &LinearParams, site: GemmSite) -> Linear {
        Linear {
            w: params.weight.offset,
            b: params.bias.offset,
            out: params.out_features(),
            inp: params.in_features(),
            site,
        }
    }

    fn w_len(&self) -> usize {
        self.out * self.inp
    }

    /// `y[n, o] = x[n, i] W^T + b` (the bias added by the GEMM: [`super::gemm::gemm_bias`]),
    /// on the route `gemms` says. `x` and `params` (the flat parameters) may carry bf16 copies
    /// the GEMM then reads instead of rounding.
    pub fn forward<A: Element>(
        &self,
        gemms: Gemms,
        y: &mut [A],
        x: Flat<'_, A>,
        params: Flat<'_, A>,
        n: usize,
    ) {
        let bias = &params.f32[self.b..self.b + self.out];
        let w = params.mat(self.w, self.out, self.inp);
        gemm_bias(
            gemms,
            self.site,
            x.mat(0, n, self.inp),
            w.t(),
            bias,
            &mut mat_mut(y, n, self.out),
        );
    }

    /// Given `dy[n, o]`: `dW += dy^T x`, `db += sum_n dy`, and `dx[n, i] = dy W`
    /// (`dx += dy W` when `accumulate_dx`). `dx: None` skips the input gradient. On the native
    /// bf16 route `dy` is rounded once for both GEMMs, in place, after the bias gradient (its
    /// last f32 reader): the caller's `dy` is then lost.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<A: Element>(
        &self,
        gemms: Gemms,
        dx: Option<(&mut [A], bool)>,
        dy: &mut [A],
        x: Flat<'_, A>,
        params: Flat<'_, A>,
        grads: &mut [A],
        n: usize,
    ) {
        let dy = &mut dy[..n * self.out];
        bias_gradient(&mut grads[self.b..self.b + self.out], dy, n);
        // `dy` feeds both GEMMs: round it once.
        let dy = round_in_place(gemms, dy);
        let dy_m = dy.mat(0, n, self.out);
        {
            let mut dw = mat_mut(
                &mut grads[self.w..self.w + self.w_len()],
                self.out,
                self.inp,
            );
            let x = x.mat(0, n, self.inp);
            gemm(gemms, self.site, A::one(), dy_m.t(), x, A::one(), &mut dw);
        }
        if let Some((dx, accumulate)) = dx {
            let w = params.mat(self.w, self.out, self.inp);
            let beta = if accumulate { A::one() } else { A::zero() };
            let dx = &mut mat_mut(dx, n, self.inp);
            gemm(gemms, self.site, A::one(), dy_m, w, beta, dx);
        }
    }
}

/// Rows of `dy` per block of the bias gradient's sum: the result depends on this, never on
/// the thread count.
const BIAS_BLOCK_ROWS: usize = 256;

/// `db[o] += sum_n dy[n, o]`: each block of [`BIAS_BLOCK_ROWS`] rows summed in row order (the
/// blocks cut among the model's threads, each reading whole rows), then the block sums added
/// to `db` in block order. (Cutting the columns instead made each thread pull every row
/// through its cache: slower on 2 threads than on 1 at BERT-tiny's 128 columns.)
pub(crate) fn bias_gradient<A: Element>(db: &mut [A], dy: &[A], n: usize) {
    let o = db.len();
    let _region = region(Pass::BiasGradient, bytes::<A>(n * o + o), bytes::<A>(o));
    let whole = n / BIAS_BLOCK_ROWS;
    let mut sums = vec![A::zero(); (whole + 1) * o];
    let (full, tail) = sums.split_at_mut(whole * o);
    let block = BIAS_BLOCK_ROWS * o;
    parallel::zip_units(
        full,
        o,
        &dy[..whole * block],
        block,
        whole,
        1,
        |sums, dy| {
            for (sum, rows) in sums.chunks_exact_mut(o).zip(dy.chunks_exact(block)) {
                sum_rows(sum, rows);
            }
        },
    );
    sum_rows(tail, &dy[whole * block..n * o]);
    for sum in sums.chunks_exact(o) {
        for (g, &s) in db.iter_mut().zip(sum) {
            *g += s;
        }
    }
}

/// `sum[j] += rows[i, j]` over the rows of `rows` `[r, sum.len()]`, in order.
fn sum_rows<A: Element>(sum: &mut [A], rows: &[A]) {
    for row in rows.chunks_exact(sum.len()) {
        for (s, &d) in sum.iter_mut().zip(row) {
            *s += d;
        }
    }
}
