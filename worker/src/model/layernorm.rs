//! Layer normalisation over the hidden channels (Ba et al. 2016, eq. 4; HF: `nn.LayerNorm`
//! with `layer_norm_eps`), optionally fused with the residual add that precedes it in BERT's
//! post-LN blocks.
//!
//! Shapes: `x`, `y`, `xhat` `[n, c]`; `rstd` `[n]`; `gamma`, `beta` `[c]`.
//! `y = xhat * gamma + beta`, `xhat = (x - mean) * rstd`, `rstd = 1 / sqrt(var + eps)` with the
//! biased variance, as PyTorch.

use keel_proto::params::ParamLayout;

use super::Element;
use super::linear::find;

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
    /// The LayerNorm named `{prefix}.weight` / `{prefix}.bias` in the layout.
    pub fn new(layout: &ParamLayout, prefix: &str, eps: f64) -> LayerNorm {
        let g = find(layout, &format!("{prefix}.weight"));
        let b = find(layout, &format!("{prefix}.bias"));
        LayerNorm {
            gamma: g.offset,
            beta: b.offset,
            c: g.shape[0],
            eps,
        }
    }

    /// `y = LN(x + residual)` (`residual: None` for a plain LN); saves `xhat` and `rstd` for
    /// the backward.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
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
        let gamma = &params[self.gamma..self.gamma + c];
        let beta = &params[self.beta..self.beta + c];
        let inv_c = A::one() / A::of(c as f64);
        let eps = A::of(self.eps);
        for r in 0..n {
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
            rstd[r] = rs;
            for (((o, v), &g), &b) in y[row].iter_mut().zip(xh.iter_mut()).zip(gamma).zip(beta) {
                *v *= rs;
                *o = *v * g + b;
            }
        }
    }

    /// Given `dy`: `dgamma += sum_n dy * xhat`, `dbeta += sum_n dy`, and
    /// `dx = rstd * (dy*gamma - mean(dy*gamma) - xhat * mean(dy*gamma*xhat))` written to `dx`.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
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
        let inv_c = A::one() / A::of(c as f64);
        let gamma = &params[self.gamma..self.gamma + c];
        for r in 0..n {
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
            let rs = rstd[r];
            for (((o, &d), &g), &xh) in dx[row].iter_mut().zip(dy_r).zip(gamma).zip(xh_r) {
                *o = rs * (d * g - mean_dn - xh * mean_dnx);
            }
            let dgamma = &mut grads[self.gamma..self.gamma + c];
            for ((dg, &d), &xh) in dgamma.iter_mut().zip(dy_r).zip(xh_r) {
                *dg += d * xh;
            }
            let dbeta = &mut grads[self.beta..self.beta + c];
            for (db, &d) in dbeta.iter_mut().zip(dy_r) {
                *db += d;
            }
        }
    }
}
