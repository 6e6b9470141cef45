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
/// Errors: [`TrainError::Broadcast`] with [`BroadcastError::Incomplete`] when a share of the
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
    let fail = |source: BroadcastError| TrainError::Broadcast {
        step,
        root: root_rank,
        source,
    };
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
        return Err(incomplete(format!(
            "the shares of rank(s) {missing:?} of the last generation's {old} are gone"
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
