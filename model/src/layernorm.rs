//! Layer normalisation over the hidden channels (Ba et al. 2016, eq. 4; HF: `nn.LayerNorm`
//! with `layer_norm_eps`), optionally fused with the residual add that precedes it in BERT's
//! post-LN blocks.
//!
//! Shapes: `x`, `y`, `xhat` `[n, c]`; `rstd` `[n]`; `gamma`, `beta` `[c]`.
//! `y = xhat * gamma + beta`, `xhat = (x - mean) * rstd`, `rstd = 1 / sqrt(var + eps)` with the
//! biased variance, as PyTorch.

use super::pass_profile::{Pass, bytes, region};
use keel_proto::params::LayerNormParams;

use super::Element;
use super::parallel::{available_threads, run_parts, split};

/// Where a LayerNorm's `gamma` (weight) and `beta` (bias) live in the flat buffer.
#[derive(Debug, Clone)]
pub(crate) struct LayerNorm {
    gamma: usize,
    beta: usize,
    /// Channels `c`.
    c: usize,
    /// Added to the variance (config `layer_norm_eps`).
    eps: f64,
}

impl LayerNorm {
    /// The LayerNorm over these tensors of the layout, with `eps` added to the variance.
    pub fn new(params: &LayerNormParams, eps: f64) -> LayerNorm {
        LayerNorm {
            gamma: params.weight.offset,
            beta: params.bias.offset,
            c: params.weight.shape[0],
            eps,
        }
    }

    /// `y = LN(x + residual)` (`residual: None` for a plain LN); saves `xhat` and `rstd` for
    /// the backward.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<A: Element>(
        &self,
        y: &mut [A],
        xhat: &mut [A],
        rstd: &mut [A],
        x: &[A],
        residual: Option<&[A]>,
        params: &[A],
        n: usize,
    ) {
        let c = self.c;
        let _region = region(
            Pass::LayerNormForward,
            bytes::<A>(n * c * (1 + usize::from(residual.is_some())) + 2 * c),
            bytes::<A>(2 * n * c + n),
        );
        let gamma = &params[self.gamma..self.gamma + c];
        let beta = &params[self.beta..self.beta + c];
        let eps = A::of(self.eps);
        // Rows are independent: cut among the model's threads (the same numbers whatever the
        // cut).
        let ranges = split(n, available_threads().min(n / MIN_ROWS).max(1));
        let (mut y, mut xhat, mut rstd) = (&mut y[..n * c], &mut xhat[..n * c], &mut rstd[..n]);
        let mut work = Vec::with_capacity(ranges.len());
        for r in &ranges {
            let (y_r, y_rest) = y.split_at_mut(r.len() * c);
            let (xh_r, xh_rest) = xhat.split_at_mut(r.len() * c);
            let (rs_r, rs_rest) = rstd.split_at_mut(r.len());
            (y, xhat, rstd) = (y_rest, xh_rest, rs_rest);
            let rows = r.start * c..r.end * c;
            let res = residual.map(|res| &res[rows.clone()]);
            work.push((y_r, xh_r, rs_r, &x[rows], res));
        }
        run_parts(work, |(y, xhat, rstd, x, residual)| {
            forward_rows(y, xhat, rstd, x, residual, gamma, beta, eps);
        });
    }

    /// Given `dy`: `dgamma += sum_n dy * xhat`, `dbeta += sum_n dy`, and
    /// `dx = rstd * (dy*gamma - mean(dy*gamma) - xhat * mean(dy*gamma*xhat))` written to `dx`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<A: Element>(
        &self,
        dx: &mut [A],
        dy: &[A],
        xhat: &[A],
        rstd: &[A],
        params: &[A],
        grads: &mut [A],
        n: usize,
    ) {
        let c = self.c;
        let _region = region(
            Pass::LayerNormBackward,
            bytes::<A>(2 * n * c + n + 3 * c),
            bytes::<A>(n * c + 2 * c),
        );
        let gamma = &params[self.gamma..self.gamma + c];
        // Blocks of rows cut among the model's threads: each block's `dx` rows, then, while
        // they are still in cache, the block's sums for dgamma and dbeta. The block sums are
        // added in block order afterwards, so the result does not depend on the thread count.
        let blocks = n.div_ceil(GRADIENT_BLOCK_ROWS);
        let mut sums = vec![A::zero(); blocks * 2 * c];
        let ranges = split(blocks, available_threads().min(n / MIN_ROWS).max(1));
        let (mut dx_rest, mut sums_rest) = (&mut dx[..n * c], &mut sums[..]);
        let mut work = Vec::with_capacity(ranges.len());
        for r in &ranges {
            let rows = r.start * GRADIENT_BLOCK_ROWS..(r.end * GRADIENT_BLOCK_ROWS).min(n);
            let (dx_r, tail) = dx_rest.split_at_mut(rows.len() * c);
            dx_rest = tail;
            let (sums_r, tail) = sums_rest.split_at_mut(r.len() * 2 * c);
            sums_rest = tail;
            let elems = rows.start * c..rows.end * c;
            work.push((dx_r, sums_r, &dy[elems.clone()], &xhat[elems], &rstd[rows]));
        }
        run_parts(work, |(dx, sums, dy, xhat, rstd)| {
            let block = GRADIENT_BLOCK_ROWS * c;
            for ((((dx, sums), dy), xhat), rstd) in dx
                .chunks_mut(block)
                .zip(sums.chunks_exact_mut(2 * c))
                .zip(dy.chunks(block))
                .zip(xhat.chunks(block))
                .zip(rstd.chunks(GRADIENT_BLOCK_ROWS))
            {
                dx_rows(dx, dy, xhat, rstd, gamma);
                let (dgamma, dbeta) = sums.split_at_mut(c);
                for (dy_r, xh_r) in dy.chunks_exact(c).zip(xhat.chunks_exact(c)) {
                    for (((dg, db), &d), &xh) in
                        dgamma.iter_mut().zip(dbeta.iter_mut()).zip(dy_r).zip(xh_r)
                    {
                        *dg += d * xh;
                        *db += d;
                    }
                }
            }
        });
        for block in sums.chunks_exact(2 * c) {
            let (dg, db) = block.split_at(c);
            for (g, &v) in grads[self.gamma..self.gamma + c].iter_mut().zip(dg) {
                *g += v;
            }
            for (g, &v) in grads[self.beta..self.beta + c].iter_mut().zip(db) {
                *g += v;
            }
        }
    }
}

/// Rows per block of the dgamma and dbeta sums: the result depends on this, never on the
/// thread count.
const GRADIENT_BLOCK_ROWS: usize = 256;

/// Fewest rows worth a thread of their own.
const MIN_ROWS: usize = 64;

/// [`LayerNorm::forward`] over whole rows (`y`, `xhat`, `x`, `residual` `[r, c]`, `rstd` `[r]`).
#[allow(clippy::too_many_arguments)]
fn forward_rows<A: Element>(
    y: &mut [A],
    xhat: &mut [A],
    rstd: &mut [A],
    x: &[A],
    residual: Option<&[A]>,
    gamma: &[A],
    beta: &[A],
    eps: A,
) {
    let c = gamma.len();
    let inv_c = A::one() / A::of(c as f64);
    for (r, rs_out) in rstd.iter_mut().enumerate() {
        let row = r * c..(r + 1) * c;
        let xh = &mut xhat[row.clone()];
        match residual {
            Some(res) => {
                for ((o, &a), &b) in xh.iter_mut().zip(&x[row.clone()]).zip(&res[row.clone()]) {
                    *o = a + b;
                }
            }
            None => xh.copy_from_slice(&x[row.clone()]),
        }
        let mean = xh.iter().copied().sum::<A>() * inv_c;
        let mut var = A::zero();
        for v in xh.iter_mut() {
            *v -= mean;
            var += *v * *v;
        }
        let rs = A::one() / (var * inv_c + eps).sqrt();
        *rs_out = rs;
        for (((o, v), &g), &b) in y[row].iter_mut().zip(xh.iter_mut()).zip(gamma).zip(beta) {
            *v *= rs;
            *o = *v * g + b;
        }
    }
}

/// `dx = rstd * (dy*gamma - mean(dy*gamma) - xhat * mean(dy*gamma*xhat))` over whole rows
/// (`dx`, `dy`, `xhat` `[r, c]`, `rstd` `[r]`).
fn dx_rows<A: Element>(dx: &mut [A], dy: &[A], xhat: &[A], rstd: &[A], gamma: &[A]) {
    let c = gamma.len();
    let inv_c = A::one() / A::of(c as f64);
    for (r, &rs) in rstd.iter().enumerate() {
        let row = r * c..(r + 1) * c;
        let (dy_r, xh_r) = (&dy[row.clone()], &xhat[row.clone()]);
        let mut sum_dn = A::zero();
        let mut sum_dnx = A::zero();
        for ((&d, &g), &xh) in dy_r.iter().zip(gamma).zip(xh_r) {
            let dn = d * g;
            sum_dn += dn;
            sum_dnx += dn * xh;
        }
        let (mean_dn, mean_dnx) = (sum_dn * inv_c, sum_dnx * inv_c);
        for (((o, &d), &g), &xh) in dx[row].iter_mut().zip(dy_r).zip(gamma).zip(xh_r) {
            *o = rs * (d * g - mean_dn - xh * mean_dnx);
        }
    }
}
