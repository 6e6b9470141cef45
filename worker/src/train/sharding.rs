//! ZeRO stage 1 in the step (`train.shard_optimizer`; Rajbhandari et al. 2020, "ZeRO: Memory
//! Optimizations Toward Training Trillion Parameter Models", section 5.1, P_os).
//!
//! The gradient buckets stay as they are (`crate::buckets`), but each goes to the ring as a
//! reduce-scatter: rank r is left the summed gradient of its own chunk of every bucket,
//! [`owned_chunk`] (the chunk an all-reduce's reduce-scatter finishes there, so the sums are the
//! all-reduce's, bit for bit). Those chunks are the elements whose AdamW/LAMB moments the rank
//! keeps ([`crate::optim::ShardPlan::owned`]) and whose weights it updates. Then the updated
//! weights go around as an all-gather of the same buckets. The bytes on the wire are the
//! all-reduce's: `(W - 1) / W` of the buffer each way.
//!
//! What needs the whole gradient becomes a sum of per-rank parts: the global norm for clipping
//! (each rank's sum of squares of its chunks, all-reduced), and LAMB's per-tensor norms (the
//! optimizer sums them through the closure [`Sharding::sum_across`] gives it).
//!
//! Shapes: `P` parameters (the flat buffer), `W` world size.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use super::setup::TrainSetup;
use crate::allreduce::{Collective, WireDtype, owned_chunk};
use crate::buckets::{SpecialBucket, bucket_ranges};
use crate::model::{Bert, ModelError};
use crate::optim::ShardPlan;
use crate::replica::Replica;
use crate::ringlink::{RingLink, RingLinkError, RingReply};
use keel_proto::params::ParamLayout;

/// An optimizer's state buffers gathered to `[P]`, named, in `Optimizer::state` order.
pub type GatheredState = Vec<(&'static str, Vec<f32>)>;

/// Buckets of an all-gather away at the ring at a time: enough to keep the ring busy while
/// the previous bucket is copied out, few enough that the copies stay small.
pub const GATHER_WINDOW: usize = 2;

/// Which chunks of the flat buffer this rank owns, and the collectives over them.
#[derive(Debug, Clone)]
pub struct Sharding {
    /// The gradient buckets' ranges of `[P]`, in buffer order (the units of the collectives).
    buckets: Vec<Range<usize>>,
    /// This rank's chunk of each bucket, in buffer order.
    owned: Vec<Range<usize>>,
    /// Ranks sharing the state (1: this rank owns everything, nothing travels).
    world_size: usize,
}

impl Sharding {
    /// The job's sharding when `train.shard_optimizer` is set: rank `setup.rank` of
    /// `setup.world_size` over the gradient buckets the trainer will use (the model's
    /// ready ranges cut by `train.bucket_mib`, see `Trainer::new`).
    ///
    /// Errors: [`ModelError`] for a config the model refuses.
    pub fn for_job(setup: &TrainSetup) -> Result<Option<Sharding>, ModelError> {
        if !setup.spec.train.shard_optimizer {
            return Ok(None);
        }
        Sharding::for_world(setup, setup.world_size, setup.rank).map(Some)
    }

    /// The sharding rank `rank` of a generation of `world_size` ranks of this job had (its
    /// buckets depend on the world: one rank sends the word embeddings' gradient whole).
    ///
    /// Errors: [`ModelError`] for a config the model refuses.
    pub fn for_world(
        setup: &TrainSetup,
        world_size: u32,
        rank: u32,
    ) -> Result<Sharding, ModelError> {
        let config = &setup.config;
        // A model holds no weights and no activations until its first batch: cheap.
        let model = Bert::<f32>::new(config, config.heads())?;
        let split_lookup = world_size > 1 && setup.spec.diloco.is_none();
        let groups = model.ready_ranges(split_lookup);
        let buckets = bucket_ranges(&groups, setup.bucket_elems());
        Ok(Sharding::new(buckets, world_size as usize, rank as usize))
    }

    /// Rank `rank` of `world_size` over `buckets` (ranges of `[P]` in buffer order, covering
    /// it exactly once: `crate::buckets::bucket_ranges`).
    pub fn new(buckets: Vec<Range<usize>>, world_size: usize, rank: usize) -> Sharding {
        let owned = buckets
            .iter()
            .map(|b| {
                let c = owned_chunk(b.len(), world_size, rank);
                b.start + c.start..b.start + c.end
            })
            .collect();
        Sharding {
            buckets,
            owned,
            world_size,
        }
    }

    /// This rank's chunks of `[P]`, in buffer order (some may be empty).
    pub fn owned(&self) -> &[Range<usize>] {
        &self.owned
    }

    /// The optimizer's plan over `layout`: the owned chunks cut at the tensors' edges.
    pub fn plan(&self, layout: &ParamLayout) -> ShardPlan {
        ShardPlan::owned(layout, &self.owned)
    }

    /// The L2 norm of the summed gradient `[P]`, of which this rank holds its chunks: each
    /// rank's sum of squares (f64, rounded to f32 to travel) all-reduced, the same bits on
    /// every rank.
    ///
    /// Errors: [`RingLinkError`].
    pub fn grad_norm(
        &self,
        grads: &[f32],
        ring: &RingLink,
        step: u64,
    ) -> Result<f32, RingLinkError> {
        let squares: f64 = self
            .owned
            .iter()
            .map(|r| crate::optim::sum_of_squares(&grads[r.clone()]))
            .sum();
        let sum = ring.all_reduce(step, SpecialBucket::GradNorm.id(), vec![squares as f32])?;
        Ok(sum.first().copied().unwrap_or(0.0).sqrt())
    }

    /// Clips this rank's chunks of `grads` `[P]` to global norm `max_norm`, given the global
    /// `norm`, with `torch.nn.utils.clip_grad_norm_`'s factor `max_norm / (norm + 1e-6)` when
    /// it is below 1 (as `crate::optim::clip_grad_norm`).
    pub fn clip(&self, grads: &mut [f32], norm: f32, max_norm: f32) {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            for r in &self.owned {
                grads[r.clone()].iter_mut().for_each(|g| *g *= coef);
            }
        }
    }

    /// A closure for `Optimizer::step_sharded`: sums a vector across ranks as `step`'s
    /// [`SpecialBucket::TrustNorms`] (to the end, even if the job is stopped meanwhile: see
    /// [`Sharding::update`]), keeping the first error in `error`.
    pub fn sum_across<'a>(
        ring: &'a RingLink,
        step: u64,
        error: &'a mut Option<RingLinkError>,
    ) -> impl FnMut(Vec<f32>) -> Option<Vec<f32>> + 'a {
        move |values| match ring
            .submit_to_the_end(
                step,
                SpecialBucket::TrustNorms.id(),
                values,
                WireDtype::F32,
                Collective::AllReduce,
            )
            .wait()
        {
            Ok(sum) => Some(sum),
            Err(e) => {
                error.get_or_insert(e);
                None
            }
        }
    }

    /// All-gathers `buf` `[P]` bucket by bucket, as buckets `first_id..` of `step`: every
    /// rank's chunks of `buf` go to every rank (the other elements of `buf` are overwritten).
    /// Exact (f32 on the wire). Runs to the end even if the job is stopped meanwhile (see
    /// [`Sharding::update`]). At most [`GATHER_WINDOW`] buckets are away at a time, so the
    /// copies it makes stay a few buckets large whatever the model.
    ///
    /// Errors: [`RingLinkError`] (`buf` may then hold some buckets gathered, some not).
    pub fn all_gather(
        &self,
        buf: &mut [f32],
        ring: &RingLink,
        step: u64,
        first_id: u32,
    ) -> Result<(), RingLinkError> {
        let buf = RefCell::new(buf);
        self.gather_each(
            ring,
            (step, first_id, true),
            &mut |b| buf.borrow()[self.buckets[b].clone()].to_vec(),
            &mut |b, data| buf.borrow_mut()[self.buckets[b].clone()].copy_from_slice(&data),
        )
    }

    /// Runs one all-gather per bucket, as buckets `first_id..` of `step`, with
    /// `contribution(b)` the buffer of bucket `b` (its length; this rank's chunk filled in)
    /// and `receive(b, gathered)` given the result, at most [`GATHER_WINDOW`] buckets away at
    /// a time.
    ///
    /// Errors: [`RingLinkError`].
    fn gather_each(
        &self,
        ring: &RingLink,
        (step, first_id, to_the_end): (u64, u32, bool),
        contribution: &mut dyn FnMut(usize) -> Vec<f32>,
        receive: &mut dyn FnMut(usize, Vec<f32>),
    ) -> Result<(), RingLinkError> {
        let mut away: VecDeque<(usize, RingReply)> = VecDeque::new();
        for b in 0..self.buckets.len() {
            if away.len() == GATHER_WINDOW
                && let Some((done, reply)) = away.pop_front()
            {
                receive(done, reply.wait()?);
            }
            let (id, data) = (first_id + b as u32, contribution(b));
            let reply = if to_the_end {
                ring.submit_to_the_end(step, id, data, WireDtype::F32, Collective::AllGather)
            } else {
                ring.submit_collective(step, id, data, WireDtype::F32, Collective::AllGather)
            };
            away.push_back((b, reply));
        }
        while let Some((done, reply)) = away.pop_front() {
            receive(done, reply.wait()?);
        }
        Ok(())
    }

    /// A sharded optimizer state `local` (`[plan.local_len()]`, this rank's chunks in buffer
    /// order, as `ShardPlan::owned` lays them out) gathered to `[P]` on rank 0, as buckets
    /// `first_id..` of `step`; every rank takes part, and only rank 0 (`is_root`) keeps the
    /// result (the others hold no more than a few buckets at a time).
    ///
    /// Errors: [`RingLinkError`].
    pub fn gather_state(
        &self,
        local: &[f32],
        is_root: bool,
        ring: &RingLink,
        step: u64,
        first_id: u32,
    ) -> Result<Option<Vec<f32>>, RingLinkError> {
        // Where each bucket's chunk starts in `local`: the chunks, concatenated.
        let mut offsets = Vec::with_capacity(self.owned.len());
        let mut next = 0usize;
        for o in &self.owned {
            offsets.push(next);
            next += o.len();
        }
        let total = self.buckets.last().map_or(0, |b| b.end);
        let mut full = is_root.then(|| vec![0.0f32; total]);
        self.gather_each(
            ring,
            (step, first_id, false),
            &mut |b| {
                let (bucket, own) = (&self.buckets[b], &self.owned[b]);
                let mut data = vec![0.0f32; bucket.len()];
                let at = own.start - bucket.start;
                data[at..at + own.len()]
                    .copy_from_slice(&local[offsets[b]..offsets[b] + own.len()]);
                data
            },
            &mut |b, data| {
                if let Some(full) = full.as_mut() {
                    full[self.buckets[b].clone()].copy_from_slice(&data);
                }
            },
        )?;
        Ok(full)
    }

    /// Buckets per all-gather (the ids one takes).
    pub fn bucket_count(&self) -> u32 {
        self.buckets.len() as u32
    }

    /// The sharded update of `step`: the optimizer updates this rank's chunks of
    /// `replica.params` from its chunks of `grads` `[P]` (LAMB's per-tensor norms summed
    /// across ranks), then the weights are all-gathered, so every rank holds all of them.
    /// Returns the time the all-gather took.
    ///
    /// Its collectives run to the end even if the job is stopped meanwhile: every rank that
    /// began the update finishes it, so a stop leaves every rank whole steps, and the ranks'
    /// shards can be gathered again by the next generation (`train::regather`).
    ///
    /// Errors: [`RingLinkError`] (a peer gone); the replica is then half-updated and must not
    /// be kept (the trainer marks it torn).
    pub fn update(
        &self,
        replica: &mut Replica,
        grads: &[f32],
        lr: f32,
        ring: &RingLink,
        step: u64,
    ) -> Result<Duration, RingLinkError> {
        let mut error = None;
        let mut sum = Sharding::sum_across(ring, step, &mut error);
        let done = replica
            .optimizer
            .step_sharded(&mut replica.params, grads, lr, &mut sum);
        drop(sum);
        if !done {
            return Err(error.unwrap_or(RingLinkError::Closed));
        }
        if self.world_size <= 1 {
            // One rank updated every weight: nothing to gather (nor to copy).
            return Ok(Duration::ZERO);
        }
        let started = Instant::now();
        let id = SpecialBucket::ParamGather.id();
        self.all_gather(&mut replica.params, ring, step, id)?;
        Ok(started.elapsed())
    }

    /// Every state buffer of `replica`'s sharded optimizer gathered to `[P]` on rank 0 (all
    /// ranks take part; the others get `None`), in `Optimizer::state` order, for a checkpoint
    /// after `step` steps.
    ///
    /// Errors: [`RingLinkError`].
    pub fn gather_optimizer_state(
        &self,
        replica: &Replica,
        is_root: bool,
        ring: &RingLink,
        step: u64,
    ) -> Result<Option<GatheredState>, RingLinkError> {
        let mut out = Vec::new();
        for (k, (name, local)) in replica.optimizer.state().into_iter().enumerate() {
            let first = SpecialBucket::StateGather.id() + k as u32 * self.bucket_count();
            if let Some(full) = self.gather_state(local, is_root, ring, step, first)? {
                out.push((name, full));
            }
        }
        Ok(is_root.then_some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_element_has_one_owner() {
        let buckets = vec![0..10, 10..11, 11..11, 11..1000, 1000..1003];
        for world in 1..=4 {
            let mut owners = vec![0u32; 1003];
            for rank in 0..world {
                let s = Sharding::new(buckets.clone(), world, rank);
                for r in s.owned() {
                    owners[r.clone()].iter_mut().for_each(|o| *o += 1);
                }
                // Owned chunks lie in their buckets, in buffer order.
                for (o, b) in s.owned().iter().zip(&buckets) {
                    assert!(o.is_empty() || (b.start <= o.start && o.end <= b.end));
                }
            }
            assert!(owners.iter().all(|&o| o == 1), "world {world}");
        }
    }

    #[test]
    fn clipping_scales_only_the_owned_chunks() {
        let s = Sharding::new(vec![0..4, 4..8], 2, 0);
        let mut g = vec![1.0f32; 8];
        s.clip(&mut g, 10.0, 1.0);
        for (i, x) in g.iter().enumerate() {
            let owned = s.owned().iter().any(|r| r.contains(&i));
            let want = if owned { 1.0 / (10.0 + 1e-6) } else { 1.0 };
            assert_eq!(*x, want, "element {i}");
        }
        // Below the limit nothing changes.
        let mut g = vec![1.0f32; 8];
        s.clip(&mut g, 0.5, 1.0);
        assert!(g.iter().all(|&x| x == 1.0));
    }
}
