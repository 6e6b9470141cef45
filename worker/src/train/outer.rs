//! DiLoCo's outer step inside the training loop (see `crate::optim::Diloco` for the math):
//! at the end of every round of `[diloco] inner_steps` local steps, the workers average their
//! outer gradients `anchor - params` with one ring all-reduce and all apply the same outer
//! step. The all-reduce travels under the gradient buckets' ids of that step, which DiLoCo's
//! local steps leave unused, in pieces of [`BUCKET_ELEMS`], as `dtype` like gradients.
//!
//! A step that ends a round is all or nothing, as every step is: its inner update is taken on
//! the replica, and if the all-reduce then fails the replica is put back as it was before the
//! step ([`Snapshot`]), so that the next generation runs the whole step again.

use crate::allreduce::WireDtype;
use crate::buckets::BUCKET_ELEMS;
use crate::replica::Replica;
use crate::ringlink::{RingLink, RingLinkError};

/// The replica before a round's last step: weights, optimizer buffers and counters.
pub struct Snapshot {
    params: Vec<f32>,
    steps_taken: u64,
    state: Vec<(&'static str, Vec<f32>)>,
    skipped_steps: u64,
}

impl Snapshot {
    /// Copies `replica`'s state (`[P]` weights and each `[P]` optimizer buffer).
    pub fn of(replica: &Replica) -> Snapshot {
        Snapshot {
            params: replica.params.clone(),
            steps_taken: replica.optimizer.steps_taken(),
            state: replica
                .optimizer
                .state()
                .into_iter()
                .map(|(name, data)| (name, data.to_vec()))
                .collect(),
            skipped_steps: replica.skipped_steps,
        }
    }

    /// Puts `replica` back as it was when the snapshot was taken.
    pub fn restore(self, replica: &mut Replica) {
        replica.params = self.params;
        replica.skipped_steps = self.skipped_steps;
        let views: Vec<(&str, &[f32])> = self
            .state
            .iter()
            .map(|(name, data)| (*name, data.as_slice()))
            .collect();
        // The buffers came from this very optimizer: same names and lengths.
        if let Err(e) = replica.optimizer.load_state(self.steps_taken, &views) {
            tracing::error!("restoring the optimizer's own snapshot failed: {e}");
        }
    }
}

/// The outer step at `step` over `world_size` ranks: all-reduces this rank's outer gradient,
/// averages it and applies it to `replica` (weights and outer state). Nothing changes unless
/// the all-reduce succeeds. Does nothing when the replica's optimizer is not DiLoCo's.
///
/// Errors: the ring's [`RingLinkError`].
pub fn outer_step(
    ring: &RingLink,
    step: u64,
    world_size: u32,
    dtype: WireDtype,
    replica: &mut Replica,
) -> Result<(), RingLinkError> {
    let Some(diloco) = replica.optimizer.outer() else {
        return Ok(());
    };
    let delta = diloco.outer_gradient(&replica.params);
    let replies: Vec<_> = delta
        .chunks(BUCKET_ELEMS)
        .enumerate()
        .map(|(bucket, piece)| ring.submit_as(step, bucket as u32, piece.to_vec(), dtype))
        .collect();
    let mut mean = Vec::with_capacity(delta.len());
    for reply in replies {
        mean.extend(reply.wait()?);
    }
    let inv = 1.0 / world_size.max(1) as f32;
    mean.iter_mut().for_each(|d| *d *= inv);
    diloco.outer_step(&mut replica.params, &mean);
    Ok(())
}
