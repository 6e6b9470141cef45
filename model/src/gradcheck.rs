//! Finite-difference checks of every layer's backward, in f64: each test takes the scalar
//! `L = sum(w * y)` of the layer's output `y` for fixed random weights `w` (so `dL/dy = w`),
//! runs the layer's backward with `dy = w`, and compares every input and parameter gradient
//! with central differences. The whole model is checked the same way in
//! `tests/gradcheck.rs`.

use keel_proto::config::{BertConfig, HiddenAct};
use keel_proto::params::{Heads, ParamLayout};

use super::activation;
use super::attention::{self, AttentionDims, AttentionScratch};
use super::attention_batched::KeptOperands;
use super::bf16_shared::Flat;
use super::dropout::DropoutKey;
use super::embeddings::{Embeddings, EmbeddingsCache, TokenInputs};
use super::encoder_layer::{EncoderLayer, LayerCache, LayerInputs, LayerScratch};
use super::gemm::GemmSite;
use super::gemms::Gemms;
use super::layernorm::LayerNorm;
use super::linear::Linear;
use super::loss::cross_entropy;
use super::mlm_head::{MlmCache, MlmHead};
use super::nsp_head::{NspCache, NspHead};
use super::packing::Packing;

const H: f64 = 1e-5;
const TOL: f64 = 1e-7;

/// Deterministic pseudo-random values in `[-scale, scale)`.
fn values(seed: u64, len: usize, scale: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Asserts `analytic` equals the central differences of `loss` at `x` (only at `indices`).
fn check(
    label: &str,
    x: &[f64],
    analytic: &[f64],
    indices: impl Iterator<Item = usize>,
    mut loss: impl FnMut(&[f64]) -> f64,
) {
    let scale = analytic.iter().fold(1e-3f64, |m, g| m.max(g.abs()));
    let mut xp = x.to_vec();
    let mut checked = 0;
    for i in indices {
        xp[i] = x[i] + H;
        let up = loss(&xp);
        xp[i] = x[i] - H;
        let down = loss(&xp);
        xp[i] = x[i];
        let fd = (up - down) / (2.0 * H);
        let err = (fd - analytic[i]).abs() / scale;
        assert!(
            err < TOL,
            "{label}[{i}]: finite difference {fd}, analytic {}, rel err {err:e}",
            analytic[i]
        );
        checked += 1;
    }
    assert!(checked > 0, "{label}: nothing checked");
}

fn config(act: HiddenAct) -> BertConfig {
    BertConfig {
        vocab_size: 19,
        hidden_size: 8,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        intermediate_size: 12,
        hidden_act: act,
        max_position_embeddings: 7,
        ..BertConfig::preset("tiny", 19).unwrap()
    }
}

fn setup(act: HiddenAct, heads: Heads) -> (BertConfig, ParamLayout, Vec<f64>) {
    let config = config(act);
    let layout = ParamLayout::bert(&config, heads);
    let params = values(1, layout.total_len(), 0.5);
    (config, layout, params)
}

/// The range of one tensor, for checking only the parameters a layer touches.
fn range_of(layout: &ParamLayout, name: &str) -> std::ops::Range<usize> {
    layout.find(name).unwrap().range()
}

// b = 2 sequences of t = 5 tokens, the second with 2 padding tokens.
const B: usize = 2;
const T: usize = 5;
const MASK: [u8; 10] = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0];
const IDS: [u64; 2] = [4, 9];
const KEY: DropoutKey = DropoutKey { seed: 11, step: 3 };

/// The rows of the `B x T` batch with `MASK`: all `B * T` (`pack = false`), or only the 8
/// real tokens.
fn packing(pack: bool) -> Packing {
    let mut p = Packing::default();
    p.plan(&MASK, B, T, &[], pack.then_some(1));
    assert_eq!(p.is_identity(), !pack);
    p
}

#[test]
fn linear() {
    let (_, layout, params) = setup(HiddenAct::Gelu, Heads::MaskedLm);
    let lin = Linear::new(
        &layout.modules().layers[0].intermediate,
        GemmSite::Intermediate,
    );
    let g = Gemms::FP32;
    let (n, i, o) = (B * T, lin.inp, lin.out);
    let x = values(2, n * i, 1.0);
    let w = values(3, n * o, 1.0);
    let forward = |p: &[f64], x: &[f64]| {
        let mut y = vec![0.0; n * o];
        lin.forward(g, &mut y, Flat::plain(x), Flat::plain(p), n);
        dot(&y, &w)
    };
    let mut grads = vec![0.0; params.len()];
    let mut dx = vec![7.0; n * i];
    let (xf, pf) = (Flat::plain(&x[..]), Flat::plain(&params[..]));
    let dx_acc = Some((&mut dx[..], false));
    lin.backward(g, dx_acc, &mut w.clone(), xf, pf, &mut grads, n);
    check("linear dx", &x, &dx, 0..n * i, |x| forward(&params, x));
    let idx = range_of(&layout, "bert.encoder.layer.0.intermediate.dense.weight").chain(range_of(
        &layout,
        "bert.encoder.layer.0.intermediate.dense.bias",
    ));
    check("linear params", &params, &grads, idx, |p| forward(p, &x));
    // Accumulating: dx += dy W.
    let mut dx2 = vec![1.0; n * i];
    let dx_acc = Some((&mut dx2[..], true));
    lin.backward(g, dx_acc, &mut w.clone(), xf, pf, &mut grads, n);
    assert!(
        dx2.iter()
            .zip(&dx)
            .all(|(a, b)| (a - 1.0 - b).abs() < 1e-12)
    );
}

#[test]
fn layernorm_with_residual() {
    let (config, layout, params) = setup(HiddenAct::Gelu, Heads::MaskedLm);
    let params_ln = &layout.modules().layers[0].attention_layer_norm;
    let ln = LayerNorm::new(params_ln, config.layer_norm_eps);
    let (n, c) = (B * T, config.hidden_size);
    let x = values(4, n * c, 2.0);
    let res = values(5, n * c, 1.0);
    let w = values(6, n * c, 1.0);
    let forward = |p: &[f64], x: &[f64], r: &[f64]| {
        let (mut y, mut xhat, mut rstd) = (vec![0.0; n * c], vec![0.0; n * c], vec![0.0; n]);
        ln.forward(&mut y, &mut xhat, &mut rstd, x, Some(r), p, n);
        (dot(&y, &w), xhat, rstd)
    };
    let (_, xhat, rstd) = forward(&params, &x, &res);
    let mut grads = vec![0.0; params.len()];
    let mut dx = vec![0.0; n * c];
    ln.backward(&mut dx, &w, &xhat, &rstd, &params, &mut grads, n);
    check("layernorm dx", &x, &dx, 0..n * c, |x| {
        forward(&params, x, &res).0
    });
    check("layernorm dresidual", &res, &dx, 0..n * c, |r| {
        forward(&params, &x, r).0
    });
    let prefix = "bert.encoder.layer.0.attention.output.LayerNorm";
    let idx = range_of(&layout, &format!("{prefix}.weight"))
        .chain(range_of(&layout, &format!("{prefix}.bias")));
    check("layernorm params", &params, &grads, idx, |p| {
        forward(p, &x, &res).0
    });
}

#[test]
fn activations() {
    let x = values(7, 200, 4.0);
    let w = values(8, 200, 1.0);
    for act in [HiddenAct::Gelu, HiddenAct::GeluNew, HiddenAct::Relu] {
        let forward = |x: &[f64]| {
            let mut y = vec![0.0; x.len()];
            activation::forward(act, &mut y, x);
            dot(&y, &w)
        };
        let mut d = w.clone();
        activation::backward(act, &mut d, &x);
        // ReLU: skip points within H of the kink.
        let idx = (0..x.len()).filter(|&i| act != HiddenAct::Relu || x[i].abs() > 10.0 * H);
        check(&format!("{act:?}"), &x, &d, idx, forward);
    }
    let tanh_loss = |x: &[f64]| {
        let mut y = vec![0.0; x.len()];
        activation::tanh_forward(&mut y, x);
        dot(&y, &w)
    };
    let mut y = vec![0.0; x.len()];
    activation::tanh_forward(&mut y, &x);
    let mut d = w.clone();
    activation::tanh_backward(&mut d, &y);
    check("tanh", &x, &d, 0..x.len(), tanh_loss);
}

#[test]
fn attention_with_padding_and_dropout() {
    let (h, d) = (2, 3);
    let c = h * d;
    let n = B * T;
    for dropout in [None, Some((KEY, &IDS[..], 0usize, 0.3))] {
        let dims = AttentionDims {
            b: B,
            t: T,
            h,
            d,
            mask: &MASK,
            dropout,
            max_positions: 7,
            gemms: Gemms::FP32,
        };
        let (q, k, v) = (
            values(9, n * c, 1.5),
            values(10, n * c, 1.5),
            values(11, n * c, 1.5),
        );
        let w = values(12, n * c, 1.0);
        let forward = |q: &[f64], k: &[f64], v: &[f64]| {
            let (mut ctx, mut probs, mut s) = (
                vec![0.0; n * c],
                vec![0.0; B * h * T * T],
                AttentionScratch::default(),
            );
            let mut kept = KeptOperands::default();
            attention::forward(&mut ctx, &mut probs, &mut s, q, k, v, &mut kept, &dims);
            (dot(&ctx, &w), probs)
        };
        let (_, probs) = forward(&q, &k, &v);
        // Padded keys get probability exactly 0.
        for bi in 0..B {
            for (j, p) in probs[bi * h * T * T..(bi + 1) * h * T * T]
                .iter()
                .enumerate()
            {
                if MASK[bi * T + j % T] == 0 {
                    assert_eq!(*p, 0.0);
                }
            }
        }
        let (mut dq, mut dk, mut dv, mut s) = (
            vec![0.0; n * c],
            vec![0.0; n * c],
            vec![0.0; n * c],
            AttentionScratch::default(),
        );
        let kept = KeptOperands::default();
        attention::backward(
            &mut dq, &mut dk, &mut dv, &mut s, &w, &probs, &q, &k, &v, &kept, &dims,
        );
        check("attention dq", &q, &dq, 0..n * c, |q| forward(q, &k, &v).0);
        check("attention dk", &k, &dk, 0..n * c, |k| forward(&q, k, &v).0);
        check("attention dv", &v, &dv, 0..n * c, |v| forward(&q, &k, v).0);
    }
}

#[test]
fn cross_entropy_loss() {
    let (r, k) = (6, 5);
    let logits = values(13, r * k, 3.0);
    let labels = [0u32, 4, 2, 2, 1, 3];
    let loss = |z: &[f64]| cross_entropy(&mut z.to_vec(), &labels, k, None).loss_sum * 0.7;
    let mut g = logits.clone();
    let ce = cross_entropy(&mut g, &labels, k, Some(0.7));
    assert!((ce.loss_sum * 0.7 - loss(&logits)).abs() < 1e-12);
    check("cross_entropy", &logits, &g, 0..r * k, loss);
}

#[test]
fn embeddings_with_dropout() {
    for pack in [false, true] {
        embeddings_with_dropout_on(&packing(pack));
    }
}

fn embeddings_with_dropout_on(packing: &Packing) {
    let (config, layout, params) = setup(HiddenAct::Gelu, Heads::MaskedLm);
    let emb = Embeddings::new(&config, &layout.modules().embeddings);
    let (n, c) = (packing.rows(), config.hidden_size);
    let ids: Vec<u32> = (0..(B * T) as u32).map(|i| (i * 7) % 19).collect();
    let types: Vec<u32> = (0..(B * T) as u32).map(|i| u32::from(i % 5 >= 3)).collect();
    let inputs = TokenInputs {
        input_ids: &ids,
        token_type_ids: &types,
        b: B,
        t: T,
        dropout: Some((KEY, &IDS)),
        packing,
    };
    let w = values(14, n * c, 1.0);
    let forward = |p: &[f64]| {
        let (mut out, mut sum, mut cache) = (
            vec![0.0; n * c],
            vec![0.0; n * c],
            EmbeddingsCache::default(),
        );
        emb.forward(&mut out, &mut cache, &mut sum, &inputs, p);
        (dot(&out, &w), cache)
    };
    let (_, cache) = forward(&params);
    let mut grads = vec![0.0; params.len()];
    let (mut dout, mut dsum) = (w.clone(), vec![0.0; n * c]);
    emb.backward(
        &mut dout, &mut dsum, &cache, &inputs, &params, &mut grads, None,
    );
    let end = layout
        .find("bert.embeddings.LayerNorm.bias")
        .unwrap()
        .range()
        .end;
    check("embeddings params", &params, &grads, 0..end, |p| {
        forward(p).0
    });
}

/// Both layouts: the padded rows, and only the real rows (attention's inputs scattered into
/// the padded layout and its output gathered back, `super::packing`).
#[test]
fn encoder_layer_with_dropout() {
    for pack in [false, true] {
        let packing = packing(pack);
        for act in [HiddenAct::Gelu, HiddenAct::GeluNew] {
            encoder_layer_with_dropout_on(act, &packing);
        }
    }
}

fn encoder_layer_with_dropout_on(act: HiddenAct, packing: &Packing) {
    {
        let (config, layout, params) = setup(act, Heads::MaskedLm);
        let layer = EncoderLayer::new(&config, &layout.modules().layers[0], 0);
        let (n, c) = (packing.rows(), config.hidden_size);
        let inputs = LayerInputs {
            b: B,
            t: T,
            mask: &MASK,
            dropout: Some((KEY, &IDS)),
            packing,
            gemms: Gemms::FP32,
        };
        let x = values(15, n * c, 1.0);
        let w = values(16, n * c, 1.0);
        let forward = |p: &[f64], x: &[f64]| {
            let (mut y, mut cache, mut tmp, mut stage, mut s) = (
                vec![0.0; n * c],
                LayerCache::default(),
                Vec::new(),
                LayerScratch::default(),
                AttentionScratch::default(),
            );
            let p = Flat::plain(p);
            layer.forward(
                &mut y, &mut cache, &mut tmp, &mut stage, &mut s, x, &inputs, p,
            );
            (dot(&y, &w), cache)
        };
        let (_, cache) = forward(&params, &x);
        let mut grads = vec![0.0; params.len()];
        let mut dx = vec![0.0; n * c];
        let mut scratch = LayerScratch::default();
        layer.backward(
            &mut dx,
            &w,
            &cache,
            &mut scratch,
            &x,
            &inputs,
            Flat::plain(&params),
            &mut grads,
        );
        check("encoder layer dx", &x, &dx, 0..n * c, |x| {
            forward(&params, x).0
        });
        let first = range_of(&layout, "bert.encoder.layer.0.attention.self.query.weight").start;
        let last = range_of(&layout, "bert.encoder.layer.0.output.LayerNorm.bias").end;
        check("encoder layer params", &params, &grads, first..last, |p| {
            forward(p, &x).0
        });
    }
}

#[test]
fn mlm_head() {
    let (config, layout, params) = setup(HiddenAct::Gelu, Heads::MaskedLm);
    let head = MlmHead::new(
        &config,
        &layout.modules().mlm,
        &layout.modules().embeddings.word,
    );
    let (n, c, v) = (B * T, config.hidden_size, config.vocab_size);
    let positions = [1usize, 4, 6, 7];
    let hidden = values(17, n * c, 1.0);
    let w = values(18, positions.len() * v, 1.0);
    let forward = |p: &[f64], h: &[f64]| {
        let mut cache = MlmCache::default();
        head.forward(Gemms::FP32, &mut cache, h, &positions, Flat::plain(p));
        (dot(&cache.logits[..positions.len() * v], &w), cache)
    };
    let (_, mut cache) = forward(&params, &hidden);
    cache.logits[..w.len()].copy_from_slice(&w);
    let mut grads = vec![0.0; params.len()];
    let mut dh = vec![0.0; n * c];
    let pf = Flat::plain(&params[..]);
    head.backward(Gemms::FP32, &mut dh, &mut cache, &positions, pf, &mut grads);
    check("mlm head dhidden", &hidden, &dh, 0..n * c, |h| {
        forward(&params, h).0
    });
    let word = range_of(&layout, "bert.embeddings.word_embeddings.weight");
    let cls = range_of(&layout, "cls.predictions.bias").start..layout.total_len();
    check("mlm head params", &params, &grads, word.chain(cls), |p| {
        forward(p, &hidden).0
    });
}

/// The `[CLS]` rows of the `B x T` batch.
const CLS: [usize; B] = [0, T];

#[test]
fn nsp_head() {
    let (config, layout, params) = setup(HiddenAct::Gelu, Heads::PreTraining);
    let head = NspHead::new(
        layout
            .modules()
            .nsp
            .as_ref()
            .expect("a PreTraining layout has the NSP head"),
    );
    let (n, c) = (B * T, config.hidden_size);
    let hidden = values(19, n * c, 1.0);
    let w = values(20, B * 2, 1.0);
    let forward = |p: &[f64], h: &[f64]| {
        let mut cache = NspCache::default();
        head.forward(Gemms::FP32, &mut cache, h, &CLS, Flat::plain(p));
        (dot(&cache.logits[..B * 2], &w), cache)
    };
    let (_, mut cache) = forward(&params, &hidden);
    cache.logits[..B * 2].copy_from_slice(&w);
    let mut grads = vec![0.0; params.len()];
    let mut dh = vec![0.0; n * c];
    let pf = Flat::plain(&params[..]);
    head.backward(Gemms::FP32, &mut dh, &mut cache, &CLS, pf, &mut grads);
    check("nsp head dhidden", &hidden, &dh, 0..n * c, |h| {
        forward(&params, h).0
    });
    let idx = range_of(&layout, "bert.pooler.dense.weight")
        .chain(range_of(&layout, "bert.pooler.dense.bias"))
        .chain(range_of(&layout, "cls.seq_relationship.weight"))
        .chain(range_of(&layout, "cls.seq_relationship.bias"));
    check("nsp head params", &params, &grads, idx, |p| {
        forward(p, &hidden).0
    });
}
