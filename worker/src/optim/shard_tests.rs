//! Sharded AdamW and LAMB against the unsharded ones, and the unsharded ones against plain
//! reference copies of the code before sharding (which the PyTorch fixtures pinned).
//!
//! The ranks' shards are cut as a ring cuts them (`shard::tests::ring_owned`). A sharded step
//! is simulated without threads: each rank first steps a clone whose cross-rank sum records
//! the rank's partial vector and fails, then, with every partial known, the real optimizer
//! steps with a sum that returns their total (summed in f32 in rank order, as a ring sums).

use keel_proto::config::BertConfig;
use keel_proto::params::ParamLayout;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::shard::tests::ring_owned;
use super::{AdamW, AdamWConfig, Diloco, DilocoConfig, Lamb, LambConfig, OptimError};
use super::{Optimizer, ShardPlan};
use crate::model::Element;

const STEPS: usize = 5;

fn layout() -> ParamLayout {
    let config = BertConfig::preset("tiny", 1000).expect("tiny");
    ParamLayout::bert(&config, config.heads())
}

/// `n` values uniform in `[-scale, scale)` from a seeded generator.
fn random<A: Element>(n: usize, scale: f64, seed: u64) -> Vec<A> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            A::of(scale * (2.0 * u - 1.0))
        })
        .collect()
}

fn bits<A: Element>(x: &[A]) -> Vec<u64> {
    x.iter().map(|v| v.to64().to_bits()).collect()
}

/// `full` with NaN everywhere outside `plan` (what a rank may hold there).
fn poisoned<A: Element>(plan: &ShardPlan, full: &[A]) -> Vec<A> {
    let mut out = vec![A::nan(); full.len()];
    plan.scatter_into(&plan.extract(full), &mut out);
    out
}

/// The state buffers of `opt` `[L]`, scattered into `[P]` buffers `full`.
fn scatter_state<A: Element, O: Optimizer<A>>(opt: &O, full: &mut [Vec<A>]) {
    for ((_, local), dst) in opt.state().iter().zip(full.iter_mut()) {
        opt.plan().scatter_into(local, dst);
    }
}

/// Unsharded: `STEPS` steps of `make(ShardPlan::full)` from `params` with `grads[step]`.
fn run_full<A: Element, O: Optimizer<A>>(
    make: &impl Fn(ShardPlan) -> O,
    layout: &ParamLayout,
    params: &[A],
    grads: &[Vec<A>],
    lr: A,
) -> (Vec<A>, O) {
    let mut opt = make(ShardPlan::full(layout));
    let mut p = params.to_vec();
    for g in grads {
        opt.step(&mut p, g, lr);
    }
    (p, opt)
}

/// Sharded over `world` ranks: the merged parameters after `STEPS` steps, and the ranks'
/// optimizers.
fn run_sharded<A: Element, O: Optimizer<A> + Clone>(
    make: &impl Fn(ShardPlan) -> O,
    layout: &ParamLayout,
    world: usize,
    params: &[A],
    grads: &[Vec<A>],
    lr: A,
) -> (Vec<A>, Vec<O>) {
    let p_len = layout.total_len();
    let mut opts: Vec<O> = (0..world)
        .map(|r| make(ShardPlan::owned(layout, &ring_owned(p_len, world, r))))
        .collect();
    let mut merged = params.to_vec();
    for g in grads {
        // Each rank's view: garbage outside what it owns.
        let mut held: Vec<Vec<A>> = opts.iter().map(|o| poisoned(o.plan(), &merged)).collect();
        let rank_grads: Vec<Vec<A>> = opts.iter().map(|o| poisoned(o.plan(), g)).collect();
        // Pass 1: every rank's partial sums.
        let mut partials: Vec<Vec<f32>> = Vec::new();
        for ((o, p), g) in opts.iter().zip(&held).zip(&rank_grads) {
            let mut probe = o.clone();
            let mut p = p.clone();
            let mut sent = None;
            let ok = probe.step_sharded(&mut p, g, lr, &mut |v| {
                sent = Some(v);
                None
            });
            match sent {
                Some(v) => {
                    assert!(!ok, "a failed exchange fails the step");
                    partials.push(v);
                }
                None => assert!(ok, "no exchange, no failure"),
            }
        }
        assert!(
            partials.is_empty() || partials.len() == world,
            "all ranks or none"
        );
        let total = partials.first().map(|first| {
            let mut total = first.clone();
            for part in &partials[1..] {
                assert_eq!(part.len(), total.len(), "one length on every rank");
                total.iter_mut().zip(part).for_each(|(t, x)| *t += x);
            }
            total
        });
        // Pass 2: the real step, then the all-gather.
        merged.fill(A::nan());
        for (rank, ((o, p), g)) in opts.iter_mut().zip(&mut held).zip(&rank_grads).enumerate() {
            let ok = o.step_sharded(p, g, lr, &mut |v| {
                assert_eq!(Some(&v), partials.get(rank), "deterministic partials");
                total.clone()
            });
            assert!(ok);
            for s in o.plan().segments() {
                merged[s.global.clone()].copy_from_slice(&p[s.global.clone()]);
            }
            let mut outside = p.clone();
            o.plan()
                .scatter_into(&vec![A::nan(); o.plan().local_len()], &mut outside);
            assert!(
                outside.iter().all(|x| x.is_nan()),
                "only owned elements written"
            );
        }
        assert!(
            !merged.iter().any(|x| x.is_nan()),
            "the ranks cover the buffer"
        );
    }
    (merged, opts)
}

fn adamw<A: Element>(plan: ShardPlan) -> AdamW<A> {
    AdamW::with_plan(plan, AdamWConfig::default())
}

fn lamb<A: Element>(plan: ShardPlan) -> Lamb<A> {
    Lamb::with_plan(plan, LambConfig::default())
}

/// Parameters `[P]` and `STEPS` gradients `[P]`.
fn inputs<A: Element>(layout: &ParamLayout) -> (Vec<A>, Vec<Vec<A>>) {
    let n = layout.total_len();
    let grads = (0..STEPS).map(|s| random(n, 1e-2, 10 + s as u64)).collect();
    (random(n, 0.05, 1), grads)
}

fn adamw_sharded_is_unsharded<A: Element>() {
    let layout = layout();
    let (params, grads) = inputs::<A>(&layout);
    let lr = A::of(1e-3);
    let (want, full) = run_full(&adamw::<A>, &layout, &params, &grads, lr);
    for world in [2, 3] {
        let (got, opts) = run_sharded(&adamw::<A>, &layout, world, &params, &grads, lr);
        assert_eq!(
            bits(&got),
            bits(&want),
            "W = {world}: parameters bit for bit"
        );
        let mut moments = vec![vec![A::nan(); layout.total_len()]; 2];
        opts.iter().for_each(|o| scatter_state(o, &mut moments));
        for ((name, want), got) in full.state().iter().zip(&moments) {
            assert_eq!(bits(got), bits(want), "W = {world}: {name} bit for bit");
        }
    }
}

#[test]
fn sharded_adamw_matches_unsharded_bit_for_bit() {
    adamw_sharded_is_unsharded::<f64>();
    adamw_sharded_is_unsharded::<f32>();
}

/// Sharded LAMB against unsharded, per entry: `||p_sharded - p|| / ||p||` below `tol(W)`.
///
/// The one difference is the trust ratio: the squared norms cross ranks as f32. Each partial
/// is rounded once (relative error u = 2^-24) and the W partials are summed in f32 (W - 1 more
/// roundings of a sum of non-negative terms), so each squared norm is off by at most W u,
/// each norm by W u / 2, the ratio by W u; one step moves an entry by `lr ||p||` (`ratio r`
/// has the norm of `p`), so it lands within `W u lr ||p||`, and `STEPS` steps within
/// `STEPS W u lr ||p||` (to first order; the feedback through `wd p` and the next norms is
/// O(lr) smaller). f64 tolerance: twice that. In f32 the per-element arithmetic also rounds
/// `lr ratio` and `p` differently once the ratio differs, by at most a few units in the last
/// place (u each) per step: f32 tolerance adds 4 u per step.
fn lamb_sharded_is_unsharded<A: Element>(f32_elements: bool) {
    let layout = layout();
    let (params, grads) = inputs::<A>(&layout);
    let lr = 1e-2;
    let u = f64::from(f32::EPSILON) / 2.0;
    let (want, full) = run_full(&lamb::<A>, &layout, &params, &grads, A::of(lr));
    for world in [2usize, 3] {
        let mut tol = 2.0 * STEPS as f64 * world as f64 * u * lr;
        if f32_elements {
            tol += STEPS as f64 * 4.0 * u;
        }
        let (got, opts) = run_sharded(&lamb::<A>, &layout, world, &params, &grads, A::of(lr));
        for e in layout.entries() {
            let (mut d, mut n) = (0.0f64, 0.0f64);
            for (g, w) in got[e.range()].iter().zip(&want[e.range()]) {
                d += (g.to64() - w.to64()).powi(2);
                n += w.to64().powi(2);
            }
            let err = d.sqrt() / n.sqrt();
            assert!(
                err <= tol,
                "W = {world}, {}: rel err {err:e} > {tol:e}",
                e.name
            );
        }
        // Every rank knows every entry's ratio (the summed norms are the same bits).
        for o in &opts {
            assert_eq!(o.last_trust_ratios(), opts[0].last_trust_ratios());
            for (r, w) in o.last_trust_ratios().iter().zip(full.last_trust_ratios()) {
                assert!((r - w).abs() <= 1e-5 * w, "W = {world}: ratio {r} vs {w}");
            }
        }
        // The moments depend on the gradients alone, so they agree exactly.
        let mut moments = vec![vec![A::nan(); layout.total_len()]; 2];
        opts.iter().for_each(|o| scatter_state(o, &mut moments));
        for ((name, want), got) in full.state().iter().zip(&moments) {
            assert_eq!(bits(got), bits(want), "W = {world}: {name} bit for bit");
        }
    }
}

#[test]
fn sharded_lamb_matches_unsharded_f64() {
    lamb_sharded_is_unsharded::<f64>(false);
}

#[test]
fn sharded_lamb_matches_unsharded_f32() {
    lamb_sharded_is_unsharded::<f32>(true);
}

/// The code before sharding, as the PyTorch fixtures pinned it: one AdamW step per entry.
fn reference_adamw<A: Element>(
    layout: &ParamLayout,
    c: &AdamWConfig,
    t: i32,
    [p, g, m, v]: [&mut [A]; 4],
    lr: A,
) {
    let (b1, b2) = (A::of(c.beta1), A::of(c.beta2));
    let (bc1, bc2) = (A::one() - b1.powi(t), A::one() - b2.powi(t));
    let (step_size, bc2_sqrt, eps) = (lr / bc1, bc2.sqrt(), A::of(c.eps));
    let lr_wd = lr * A::of(c.weight_decay);
    for e in layout.entries() {
        let shrink = if e.decay { A::one() - lr_wd } else { A::one() };
        for i in e.range() {
            p[i] *= shrink;
            m[i] = b1 * m[i] + (A::one() - b1) * g[i];
            v[i] = b2 * v[i] + (A::one() - b2) * g[i] * g[i];
            p[i] -= step_size * m[i] / (v[i].sqrt() / bc2_sqrt + eps);
        }
    }
}

/// The code before sharding: one LAMB step per entry, norms in f64 in element order.
fn reference_lamb<A: Element>(
    layout: &ParamLayout,
    c: &LambConfig,
    t: i32,
    [p, g, m, v]: [&mut [A]; 4],
    lr: A,
) {
    let (b1, b2) = (A::of(c.beta1), A::of(c.beta2));
    let (bc1, bc2) = (A::one() - b1.powi(t), A::one() - b2.powi(t));
    let eps = A::of(c.eps);
    for e in layout.entries() {
        let wd = if e.decay {
            A::of(c.weight_decay)
        } else {
            A::zero()
        };
        let mut r = vec![A::zero(); e.len];
        let (mut p_sq, mut r_sq) = (0.0f64, 0.0f64);
        for (k, i) in e.range().enumerate() {
            m[i] = b1 * m[i] + (A::one() - b1) * g[i];
            v[i] = b2 * v[i] + (A::one() - b2) * g[i] * g[i];
            r[k] = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps) + wd * p[i];
            p_sq += p[i].to64() * p[i].to64();
            r_sq += r[k].to64() * r[k].to64();
        }
        let (pn, rn) = (p_sq.sqrt(), r_sq.sqrt());
        let ratio = if e.decay && pn > 0.0 && rn > 0.0 {
            pn / rn
        } else {
            1.0
        };
        let scale = lr * A::of(ratio);
        for (k, i) in e.range().enumerate() {
            p[i] -= scale * r[k];
        }
    }
}

fn unsharded_is_unchanged<A: Element>() {
    let layout = layout();
    let n = layout.total_len();
    let (params, grads) = inputs::<A>(&layout);
    let lr = A::of(1e-3);
    for lamb_opt in [false, true] {
        let mut opt: Box<dyn Optimizer<A>> = if lamb_opt {
            Box::new(Lamb::<A>::new(&layout, LambConfig::default()))
        } else {
            Box::new(AdamW::<A>::new(&layout, AdamWConfig::default()))
        };
        let (mut p, mut rp) = (params.clone(), params.clone());
        let (mut m, mut v) = (vec![A::zero(); n], vec![A::zero(); n]);
        for (t, g) in grads.iter().enumerate() {
            let mut g_ref = g.clone();
            let bufs = [&mut rp[..], &mut g_ref[..], &mut m[..], &mut v[..]];
            let t = t as i32 + 1;
            if lamb_opt {
                reference_lamb(&layout, &LambConfig::default(), t, bufs, lr);
            } else {
                reference_adamw(&layout, &AdamWConfig::default(), t, bufs, lr);
            }
            opt.step(&mut p, g, lr);
        }
        assert_eq!(bits(&p), bits(&rp), "lamb {lamb_opt}: parameters");
        let state = opt.state();
        assert_eq!(bits(state[0].1), bits(&m), "lamb {lamb_opt}: exp_avg");
        assert_eq!(bits(state[1].1), bits(&v), "lamb {lamb_opt}: exp_avg_sq");
    }
}

#[test]
fn the_unsharded_step_is_the_code_before_sharding() {
    unsharded_is_unchanged::<f64>();
    unsharded_is_unchanged::<f32>();
}

#[test]
fn a_sharded_state_is_about_p_over_w_and_loads_from_a_full_one() {
    let layout = layout();
    let n = layout.total_len();
    let (mut params, grads) = inputs::<f64>(&layout);
    let mut full = AdamW::<f64>::new(&layout, AdamWConfig::default());
    full.step(&mut params, &grads[0], 1e-3);
    let world = 3;
    let mut local_sum = 0;
    for rank in 0..world {
        let plan = ShardPlan::owned(&layout, &ring_owned(n, world, rank));
        let mut a = AdamW::<f64>::with_plan(plan.clone(), AdamWConfig::default());
        let mut l = Lamb::<f64>::with_plan(plan.clone(), LambConfig::default());
        for (_, s) in a.state().iter().chain(l.state().iter()) {
            assert_eq!(s.len(), plan.local_len());
        }
        assert!(plan.local_len() <= n / world + 10);
        local_sum += plan.local_len();
        // A full checkpoint's buffers: the plan's elements are taken.
        a.load_state(1, &full.state()).expect("a [P] state loads");
        l.load_state(1, &full.state()).expect("a [P] state loads");
        for ((name, got), (_, want)) in a.state().iter().zip(full.state()) {
            assert_eq!(*got, plan.extract(want), "{name}");
        }
        assert_eq!(a.state(), l.state());
        assert_eq!((a.steps_taken(), l.steps_taken()), (1, 1));
        // Its own compact buffers load too.
        let own: Vec<(&str, Vec<f64>)> = a.state().iter().map(|(k, s)| (*k, s.to_vec())).collect();
        let own: Vec<(&str, &[f64])> = own.iter().map(|(k, s)| (*k, &s[..])).collect();
        a.load_state(7, &own).expect("an [L] state loads");
        assert_eq!(a.steps_taken(), 7);
        // Any other length is named.
        let short = vec![0.0; plan.local_len() + 1];
        let full_state = full.state();
        let bad = [("exp_avg", full_state[0].1), ("exp_avg_sq", &short[..])];
        let err = a.load_state(1, &bad).expect_err("a wrong length");
        let text = err.to_string();
        assert!(
            text.contains("`exp_avg_sq`") && text.contains(&n.to_string()),
            "{text}"
        );
        assert!(matches!(
            err,
            OptimError::LengthMismatch { total_len, local_len, got, .. }
                if (total_len, local_len, got) == (n, plan.local_len(), short.len())
        ));
        assert!(matches!(
            l.load_state(1, &bad[..1]),
            Err(OptimError::MissingState { name }) if name == "exp_avg_sq"
        ));
    }
    assert_eq!(local_sum, n);
}

#[test]
fn a_failed_exchange_fails_the_lamb_step() {
    let layout = layout();
    let (params, grads) = inputs::<f32>(&layout);
    let plan = ShardPlan::owned(&layout, &ring_owned(layout.total_len(), 2, 0));
    let mut opt = Lamb::<f32>::with_plan(plan, LambConfig::default());
    let mut p = params.clone();
    let mut len = 0;
    assert!(!opt.step_sharded(&mut p, &grads[0], 1e-3, &mut |v| {
        len = v.len();
        None
    }));
    assert_eq!(len, 2 * layout.entries().len());
    assert!(!opt.step_sharded(&mut p, &grads[0], 1e-3, &mut |_| Some(vec![1.0; 3])));
    assert_eq!(bits(&p), bits(&params), "no parameter moved");
    // AdamW and DiLoCo (never sharded) have the full plan's behaviour.
    let mut d = Diloco::new(
        Box::new(AdamW::<f32>::new(&layout, AdamWConfig::default())),
        layout.total_len(),
        DilocoConfig {
            outer_lr: 0.7,
            outer_momentum: 0.9,
        },
    );
    assert!(d.plan().is_full());
    let mut q = params.clone();
    assert!(d.step_sharded(&mut p, &grads[0], 1e-3, &mut |_| panic!(
        "AdamW needs no sum"
    )));
    let mut a = AdamW::<f32>::new(&layout, AdamWConfig::default());
    a.step(&mut q, &grads[0], 1e-3);
    assert_eq!(bits(&p), bits(&q));
}
