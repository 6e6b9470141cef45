//! The data plan: exact cover and world-size invariance, for many shapes.

use std::collections::{BTreeMap, BTreeSet};

use keel_proto::split::{SplitError, WorkerPlan};

#[test]
fn every_sequence_of_an_epoch_is_served_exactly_once() {
    for n in [1u64, 7, 12, 100, 257, 1000] {
        for w in 1..=5u32 {
            for b in 1..=4u32 {
                for k in 1..=3u32 {
                    let global = u64::from(w * b * k);
                    if n < global {
                        let err = WorkerPlan::new(n, w, 0, b, k).unwrap_err();
                        assert!(
                            matches!(err, SplitError::CorpusTooSmall { missing, .. } if missing == global - n)
                        );
                        continue;
                    }
                    let spe = n / global;
                    let mut seen = BTreeSet::new();
                    let mut from_batches = BTreeSet::new();
                    for r in 0..w {
                        let plan = WorkerPlan::new(n, w, r, b, k).unwrap();
                        assert_eq!(plan.steps_per_epoch(), spe);
                        let mine = plan.sequence_indices();
                        assert_eq!(mine.len() as u64, spe * u64::from(b * k), "no rank idle");
                        assert!(mine.windows(2).all(|p| p[0] < p[1]));
                        for g in mine {
                            assert!(seen.insert(g), "sequence {g} served twice");
                        }
                        let mine: BTreeSet<u64> = plan.sequence_indices().into_iter().collect();
                        for s in 0..spe {
                            for j in 0..k {
                                let mb = plan.micro_batch(s, j).unwrap();
                                assert_eq!(mb.epoch, 0);
                                assert_eq!(mb.sequence_indices.len(), b as usize);
                                for g in mb.sequence_indices {
                                    assert!(
                                        mine.contains(&g),
                                        "micro-batch reads outside its shard"
                                    );
                                    assert!(from_batches.insert(g));
                                }
                            }
                        }
                    }
                    let expected: BTreeSet<u64> = (0..spe * global).collect();
                    assert_eq!(seen, expected, "N={n} W={w} b={b} k={k}");
                    assert_eq!(from_batches, expected);
                }
            }
        }
    }
}

/// The union of all micro-batches of a step as sample id -> sequence index.
fn step_rows(n: u64, w: u32, b: u32, k: u32, step: u64) -> BTreeMap<u64, u64> {
    let mut rows = BTreeMap::new();
    for r in 0..w {
        let plan = WorkerPlan::new(n, w, r, b, k).unwrap();
        for j in 0..k {
            let mb = plan.micro_batch(step, j).unwrap();
            for (sid, g) in mb.sample_ids.into_iter().zip(mb.sequence_indices) {
                assert!(rows.insert(sid, g).is_none(), "sample id {sid} used twice");
            }
        }
    }
    rows
}

#[test]
fn global_batches_do_not_depend_on_world_size() {
    // Global batch 12 as 1x12x1, 2x3x2, 3x2x2, 4x3x1, 6x1x2 over 100 sequences, 3 epochs.
    let n = 100;
    let shapes = [(1, 12, 1), (2, 3, 2), (3, 2, 2), (4, 3, 1), (6, 1, 2)];
    let spe = n / 12;
    for step in 0..3 * spe + 2 {
        let reference = step_rows(n, 1, 12, 1, step);
        assert_eq!(reference.len(), 12);
        let p = step % spe;
        let expected: Vec<u64> = (p * 12..(p + 1) * 12).collect();
        assert_eq!(reference.values().copied().collect::<Vec<_>>(), expected);
        assert_eq!(*reference.keys().next().unwrap(), step * 12);
        for (w, b, k) in shapes {
            assert_eq!(
                step_rows(n, w, b, k, step),
                reference,
                "W={w} b={b} k={k} step={step}"
            );
        }
        let plan = WorkerPlan::new(n, 2, 1, 3, 2).unwrap();
        assert_eq!(plan.micro_batch(step, 0).unwrap().epoch, step / spe);
    }
}

#[test]
fn invalid_plans_are_errors() {
    assert!(matches!(
        WorkerPlan::new(10, 0, 0, 1, 1),
        Err(SplitError::Zero { .. })
    ));
    assert!(matches!(
        WorkerPlan::new(10, 2, 2, 1, 1),
        Err(SplitError::RankOutOfRange { .. })
    ));
    let err = WorkerPlan::new(10, 2, 0, 4, 2).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("too small") && msg.contains("16") && msg.contains("6 more"),
        "{msg}"
    );
    let plan = WorkerPlan::new(10, 1, 0, 2, 2).unwrap();
    assert!(plan.micro_batch(0, 2).is_err());
}

/// A recovered job keeps its global batch: any world size splits the same rows with the same
/// sample ids, and `with_global_batch(W*b*k)` is exactly `new(W, b, k)`.
#[test]
fn fixed_global_batch_splits_the_same_rows_for_any_world_size() {
    let (n, b, k) = (1000u64, 3u32, 2u32);
    let global = 3 * u64::from(b * k); // first generation: 3 workers
    let rows_of = |world: u32, step: u64| {
        let mut all = Vec::new();
        for r in 0..world {
            let plan = WorkerPlan::with_global_batch(n, global, world, r, b).unwrap();
            for j in 0..plan.grad_accum() {
                let mb = plan.micro_batch(step, j).unwrap();
                assert!(mb.sequence_indices.len() <= b as usize && !mb.sequence_indices.is_empty());
                all.extend(mb.sequence_indices.into_iter().zip(mb.sample_ids));
            }
        }
        all
    };
    for step in [0, 7, 55, 56, 200] {
        let reference = rows_of(3, step);
        assert_eq!(reference.len() as u64, global);
        for world in [1, 2, 4, 5, 18] {
            assert_eq!(rows_of(world, step), reference, "world {world} step {step}");
        }
    }
    for r in 0..3 {
        let a = WorkerPlan::new(n, 3, r, b, k).unwrap();
        let c = WorkerPlan::with_global_batch(n, global, 3, r, b).unwrap();
        assert_eq!(a, c);
        assert_eq!(c.grad_accum(), k);
        assert_eq!(a.sequence_indices(), c.sequence_indices());
    }
    // Each rank's shard holds exactly the rows its micro-batches read.
    for world in [2u32, 4, 5] {
        let mut union = Vec::new();
        for r in 0..world {
            let plan = WorkerPlan::with_global_batch(n, global, world, r, b).unwrap();
            union.extend(plan.sequence_indices());
        }
        union.sort_unstable();
        let spe = n / global;
        assert_eq!(union, (0..spe * global).collect::<Vec<_>>());
    }
    assert!(WorkerPlan::with_global_batch(n, 2, 3, 0, b).is_err());
}
