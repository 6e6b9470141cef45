//! The training modes of a step, each a [`GradientSync`] owning its own state:
//!
//! | mode (`plain`, `zero1`, `diloco`)  | loss averaged over | after backward   | update                                        |
//! |------------------------------------|--------------------|------------------|-----------------------------------------------|
//! | [`PlainSync`]                      | the global batch   | all-reduce       | full, the same on every rank                  |
//! | [`Zero1Sync`] (`shard_optimizer`)  | the global batch   | reduce-scatter   | this rank's chunks, then all-gather           |
//! | [`DilocoSync`] (`[diloco]`)        | this rank's batch  | nothing          | local; outer step at round ends (all or none) |
//!
//! `gradient_sync` holds the trait and the update rule the modes share; [`for_job`] picks the
//! job's mode.

pub mod diloco;
pub mod gradient_sync;
pub mod plain;
pub mod zero1;

pub use diloco::DilocoSync;
pub use gradient_sync::{GradientSync, Update, UpdateRule};
pub use plain::{BucketReducer, PlainSync};
pub use zero1::Zero1Sync;

use super::setup::TrainSetup;
use super::sharding::Sharding;
use crate::buckets::Buckets;
use std::ops::Range;

/// The mode of `setup`'s job for this rank: DiLoCo with `[diloco]`, ZeRO stage 1 with
/// `train.shard_optimizer` (the spec refuses both at once), else plain. `ready` are the
/// model's gradient ranges that become final together (`Bert::ready_ranges`), cut into
/// buckets of `train.bucket_mib`; `word_range` is the word embeddings' range `[v * c]`.
pub fn for_job(
    setup: &TrainSetup,
    ready: &[Range<usize>],
    word_range: Range<usize>,
) -> Box<dyn GradientSync> {
    let wire = setup.spec.train.allreduce_dtype.wire();
    if let Some(spec) = &setup.spec.diloco {
        return Box::new(DilocoSync::new(spec.clone(), wire, setup.world_size));
    }
    let buckets = Buckets::new(ready, setup.bucket_elems(), wire);
    if setup.spec.train.shard_optimizer {
        // The buckets go as reduce-scatters, each rank keeping its chunks.
        let (world, rank) = (setup.world_size as usize, setup.rank as usize);
        let buckets = buckets.reduce_scatter(world, rank);
        let sharding = Sharding::new(buckets.ranges().to_vec(), world, rank);
        return Box::new(Zero1Sync::new(
            BucketReducer::new(buckets, word_range),
            sharding,
        ));
    }
    Box::new(PlainSync::new(BucketReducer::new(buckets, word_range)))
}
