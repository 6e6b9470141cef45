//! A sharded job's next generation from its ranks' memory (`train.shard_optimizer`): the
//! ranks of the last generation that hold its newest step each hold one share of the moments
//! (`Replica::shard`), and together, when none is missing, all of them. The new ring sums
//! them back to whole buffers and each rank keeps its new share, whatever the new world size
//! and ranks. When a share is missing (its worker is gone), nothing can replace it: the start
//! fails with [`BroadcastError::Incomplete`], the held replicas are dropped, and the job's
//! next generation goes on from its newest checkpoint.
//!
//! Every element of a moment is held by exactly one old rank (checked: each old rank once),
//! which contributes its value while every other rank contributes `-0.0`, so the sum is the
//! value bit for bit (as `crate::replica::broadcast` does for whole replicas). The weights,
//! step and skipped-step count come from the root by `broadcast_weights`.
//!
//! Memory: one whole `[P]` buffer per moment while it is summed (as the unsharded broadcast).

use super::error::TrainError;
use super::optimizer::sharded_optimizer_for;
use super::setup::TrainSetup;
use super::sharding::Sharding;
use crate::buckets::{BUCKET_ELEMS, SpecialBucket};
use crate::optim::ShardPlan;
use crate::replica::{BroadcastError, Replica, ShardOf, broadcast_weights, from_pieces, pieces};
use crate::ringlink::{RingLink, RingReply};
use keel_proto::params::ParamLayout;

/// This rank's replica at `setup.start_step` with its share `plan` of the moments, gathered
/// from what the ranks hold (`held`: this rank's replica of any step, or nothing; the root,
/// `root_rank`, holds the start step).
///
/// Errors: [`TrainError::Regather`] with [`BroadcastError::Incomplete`] when a share of the
/// moments is missing or the holders disagree, [`BroadcastError::Ring`] from the ring,
/// [`BroadcastError::State`] when the gathered state does not fit; [`TrainError::Model`]
/// for a config the model refuses.
pub fn regather(
    setup: &TrainSetup,
    layout: &ParamLayout,
    plan: &ShardPlan,
    held: Option<Replica>,
    root_rank: u32,
    ring: &RingLink,
) -> Result<Replica, TrainError> {
    let step = setup.start_step;
    let is_root = setup.rank == root_rank;
    let fail = |source: BroadcastError| TrainError::Regather { step, source };
    let incomplete = |why: String| fail(BroadcastError::Incomplete(why));
    let held = held.filter(|r| r.step == step && r.shard.is_some());
    let origin = held.as_ref().and_then(|r| r.shard);
    if is_root && origin.is_none() {
        return Err(incomplete(format!(
            "this rank was named to give step {step} but holds no share of it"
        )));
    }
    // How many ranks hold a share, of what world; the root's optimizer step count.
    let mut scalars = vec![0.0f32; 5];
    if let Some(o) = origin {
        scalars[0] = 1.0;
        scalars[1] = o.world_size as f32;
    }
    if let Some(r) = held.as_ref().filter(|_| is_root) {
        scalars[2..5].copy_from_slice(&pieces(r.optimizer.steps_taken()));
    }
    let first = SpecialBucket::Regather.id();
    let ring_failed = |e| fail(BroadcastError::Ring(e));
    let sums = ring.all_reduce(step, first, scalars).map_err(ring_failed)?;
    let (holders, old_world) = (sums[0], sums[1]);
    let old = (old_world / holders.max(1.0)) as u32;
    if holders < 1.0 || old as f32 * holders != old_world || old == 0 {
        return Err(incomplete(format!(
            "{holders} rank(s) hold a share of step {step}, of worlds summing to {old_world}"
        )));
    }
    let steps_taken = from_pieces(&sums[2..5]);
    // Each old rank's share exactly once.
    let mut coverage = vec![0.0f32; old as usize];
    if let Some(o) = origin.filter(|o| o.rank < old && o.world_size == old) {
        coverage[o.rank as usize] = 1.0;
    }
    let coverage = ring
        .all_reduce(step, first + 1, coverage)
        .map_err(ring_failed)?;
    let missing: Vec<usize> = (0..old as usize).filter(|&r| coverage[r] != 1.0).collect();
    if !missing.is_empty() {
        let ranks: Vec<String> = missing.iter().map(|r| r.to_string()).collect();
        return Err(incomplete(format!(
            "no rank holds the share of the last ring's rank {} (of {old} ranks): its worker is \
             gone, and its share of the moments with it",
            ranks.join(", ")
        )));
    }

    let mut replica = held.unwrap_or_else(|| Replica {
        step,
        params: vec![0.0; layout.total_len()],
        optimizer: sharded_optimizer_for(&setup.spec, plan.clone()),
        skipped_steps: 0,
        shard: None,
    });
    broadcast_weights(ring, step, is_root, &mut replica).map_err(fail)?;
    let old_plan = match origin {
        Some(o) => Some(
            Sharding::for_world(setup, o.world_size, o.rank)
                .map_err(super::error::model_err(step))?
                .plan(layout),
        ),
        None => None,
    };
    let mut fresh = sharded_optimizer_for(&setup.spec, plan.clone());
    let names: Vec<&'static str> = fresh.state().iter().map(|(n, _)| *n).collect();
    let mut whole = Vec::with_capacity(names.len());
    let mut next = first + 2;
    for name in &names {
        let mut full = vec![-0.0f32; layout.total_len()];
        if let Some(old_plan) = &old_plan {
            let local = replica
                .optimizer
                .state()
                .into_iter()
                .find(|(n, _)| n == name)
                .map(|(_, d)| d)
                .ok_or_else(|| incomplete(format!("this rank's share has no `{name}`")))?;
            if local.len() != old_plan.local_len() {
                return Err(incomplete(format!(
                    "this rank's `{name}` has {} elements, its share {}",
                    local.len(),
                    old_plan.local_len()
                )));
            }
            old_plan.scatter_into(local, &mut full);
        }
        let replies: Vec<RingReply> = full
            .chunks(BUCKET_ELEMS)
            .map(|chunk| {
                next += 1;
                ring.submit(step, next - 1, chunk.to_vec())
            })
            .collect();
        let mut at = 0;
        for reply in replies {
            let sum = reply.wait().map_err(ring_failed)?;
            full[at..at + sum.len()].copy_from_slice(&sum);
            at += sum.len();
        }
        whole.push(full);
    }
    let views: Vec<(&str, &[f32])> = names
        .iter()
        .zip(&whole)
        .map(|(n, d)| (*n, d.as_slice()))
        .collect();
    fresh
        .load_state(steps_taken, &views)
        .map_err(|e| fail(BroadcastError::State(e.to_string())))?;
    drop(views);
    drop(whole);
    replica.optimizer = fresh;
    replica.shard = Some(ShardOf {
        world_size: setup.world_size,
        rank: setup.rank,
    });
    tracing::info!(
        job = %setup.job_id,
        rank = setup.rank,
        step,
        from_world = old,
        to_world = setup.world_size,
        "regathered the sharded optimizer state from the ranks' memory"
    );
    Ok(replica)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allreduce::{Mailbox, Ring, RingConfig};
    use crate::control::JobControl;
    use keel_proto::jobspec::JobSpec;
    use std::sync::Arc;

    /// A job of one rank (its all-reduces return at once) with a sharded optimizer.
    fn one_rank(rt: &tokio::runtime::Runtime) -> (TrainSetup, RingLink) {
        let text = "[data]\ncorpus = [\"/corpus.txt\"]\nvocab_size = 1000\nmax_seq_length = 64\n\
                    [model]\npreset = \"tiny\"\n[train]\nmicro_batch_size = 2\nmax_steps = 10\n\
                    shard_optimizer = true\n";
        let spec = JobSpec::from_toml_str(text, "job.toml").unwrap();
        let config = keel_proto::config::BertConfig::preset("tiny", 1000).unwrap();
        let setup = TrainSetup {
            job_id: "job-1".into(),
            generation: 2,
            rank: 0,
            world_size: 1,
            spec,
            config,
            total_sequences: 0,
            shard: "/nonexistent".into(),
            heldout: "/nonexistent".into(),
            tokenizer: "/nonexistent".into(),
            later_phases: Vec::new(),
            initial: super::super::InitialState::Init { weights: None },
            start_step: 7,
            global_batch_size: 2,
            precision: keel_proto::precision::Precision::Fp32,
            checkpoint_first: false,
            faults: crate::faults::Faults::none(),
            work_dir: "/nonexistent".into(),
        };
        let cfg = RingConfig {
            job_id: "job-1".into(),
            generation: 2,
            rank: 0,
            world_size: 1,
            peers: vec!["127.0.0.1:9".into()],
            streams_per_link: 1,
            frame_bytes: 1 << 16,
            timeout: std::time::Duration::from_secs(5),
        };
        let ring = rt.block_on(Ring::connect(cfg, Mailbox::new())).unwrap();
        let _entered = rt.enter();
        let link = RingLink::spawn(
            Arc::new(ring),
            Arc::new(std::sync::atomic::AtomicU64::new(0)),
            Arc::new(JobControl::new()),
            crate::faults::Faults::none(),
        );
        (setup, link)
    }

    /// A replica at `step` holding the share of rank `rank` of `world` ranks, moments set to
    /// `value` + the element's index.
    fn held(setup: &TrainSetup, layout: &ParamLayout, step: u64, world: u32, rank: u32) -> Replica {
        let old = Sharding::for_world(setup, world, rank)
            .unwrap()
            .plan(layout);
        let mut optimizer = sharded_optimizer_for(&setup.spec, old.clone());
        let full: Vec<f32> = (0..layout.total_len()).map(|i| i as f32).collect();
        let local = old.extract(&full);
        optimizer
            .load_state(3, &[("exp_avg", &local), ("exp_avg_sq", &local)])
            .unwrap();
        Replica {
            step,
            params: vec![0.5; layout.total_len()],
            optimizer,
            skipped_steps: 1,
            shard: Some(ShardOf {
                world_size: world,
                rank,
            }),
        }
    }

    #[test]
    fn the_whole_state_of_one_old_rank_is_gathered_and_a_missing_share_is_named() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (setup, link) = one_rank(&rt);
        let layout = ParamLayout::bert(&setup.config, setup.config.heads());
        let plan = Sharding::for_world(&setup, 1, 0).unwrap().plan(&layout);
        // One old rank of one: its share is everything; it comes back whole.
        let got = regather(
            &setup,
            &layout,
            &plan,
            Some(held(&setup, &layout, 7, 1, 0)),
            0,
            &link,
        )
        .unwrap();
        assert_eq!(
            got.shard,
            Some(ShardOf {
                world_size: 1,
                rank: 0
            })
        );
        assert_eq!(
            (got.step, got.skipped_steps, got.optimizer.steps_taken()),
            (7, 1, 3)
        );
        for (name, state) in got.optimizer.state() {
            assert!(
                state.iter().enumerate().all(|(i, &x)| x == i as f32),
                "{name} did not come back whole"
            );
        }
        // Rank 0 of an old ring of 2 alone: rank 1's share is missing, and said so.
        let err = regather(
            &setup,
            &layout,
            &plan,
            Some(held(&setup, &layout, 7, 2, 0)),
            0,
            &link,
        )
        .unwrap_err();
        assert!(err.is_recoverable(), "{err}");
        let text = err.to_string();
        assert!(text.contains("last ring's rank 1 (of 2 ranks)"), "{text}");
        // A replica of another step is no share of this one.
        let err = regather(
            &setup,
            &layout,
            &plan,
            Some(held(&setup, &layout, 6, 1, 0)),
            0,
            &link,
        )
        .unwrap_err();
        assert!(err.to_string().contains("holds no share"), "{err}");
    }
}
