//! Where a generation's starting state comes from (protocol steps 7 and 14): the job seed or
//! HF weights at step 0, a stored checkpoint, or this rank's held [`Replica`] plus a broadcast
//! from the root rank.

use super::error::{TrainError, io_err};
use super::optimizer::{optimizer_for, sharded_optimizer_for};
use super::setup::TrainSetup;
use crate::model::init_params;
use crate::optim::ShardPlan;
use crate::replica::{Replica, ShardOf, broadcast};
use crate::ringlink::RingLink;
use keel_proto::checkpoint::TrainerState;
use keel_proto::params::ParamLayout;
use std::path::PathBuf;

/// Where a generation's starting state comes from (`StartJob.state_source`).
#[derive(Debug)]
pub enum InitialState {
    /// Step 0: from the job seed, or from HF weights (`init_checkpoint`).
    Init {
        /// HF `model.safetensors`, or `None` for the seed.
        weights: Option<PathBuf>,
    },
    /// A stored checkpoint of `start_step`.
    Checkpoint {
        /// Its `model.safetensors`.
        weights: PathBuf,
        /// Its `optimizer.safetensors`.
        optimizer: PathBuf,
        /// Its `trainer_state.json` (skipped-step count), if sent.
        state: Option<PathBuf>,
    },
    /// Memory: this rank's held replica (if it has one), then a broadcast from `root_rank`.
    Memory {
        /// What this worker holds of the job, at any step.
        held: Option<Replica>,
        /// The rank whose replica everyone takes.
        root_rank: u32,
    },
}

/// Builds this rank's starting replica (weights `[P]` over `layout`, optimizer state, step)
/// from `initial`: from the seed or HF weights, from a checkpoint, or from memory plus a
/// broadcast from the root rank (every rank of the ring takes part in it).
///
/// Errors: [`TrainError::Io`] for unreadable weights, optimizer or trainer state;
/// [`TrainError::Broadcast`]; [`TrainError::Regather`] (a sharded optimizer's shares, `plan`
/// being this rank's); [`TrainError::Data`] when this rank was named the root but does not
/// hold `setup.start_step`.
pub fn starting_replica(
    initial: InitialState,
    setup: &TrainSetup,
    layout: &ParamLayout,
    plan: Option<ShardPlan>,
    ring: &RingLink,
) -> Result<Replica, TrainError> {
    let t = &setup.spec.train;
    let step = setup.start_step;
    let io = io_err(step);
    // With `train.shard_optimizer`, moments for this rank's chunks only (a checkpoint's
    // whole buffers are cut down to them as they load).
    let shard = plan.as_ref().map(|_| ShardOf {
        world_size: setup.world_size,
        rank: setup.rank,
    });
    let fresh_optimizer = || match &plan {
        Some(plan) => sharded_optimizer_for(&setup.spec, plan.clone()),
        None => optimizer_for(&setup.spec, layout),
    };
    match initial {
        InitialState::Init { weights } => {
            let params = match &weights {
                Some(path) => keel_proto::weights::load_safetensors(path, layout)
                    .map_err(|e| io(format!("{}: {e}", path.display())))?,
                None => init_params(&setup.config, layout, t.seed),
            };
            Ok(Replica {
                step: 0,
                params,
                optimizer: fresh_optimizer(),
                skipped_steps: 0,
                shard,
            })
        }
        InitialState::Checkpoint {
            weights,
            optimizer,
            state,
        } => {
            let params = keel_proto::weights::load_safetensors(&weights, layout)
                .map_err(|e| io(format!("{}: {e}", weights.display())))?;
            let mut opt = fresh_optimizer();
            crate::optim_state::load(&optimizer, opt.as_mut(), &t.optimizer)
                .map_err(|e| io(e.to_string()))?;
            let skipped_steps = match &state {
                Some(path) => {
                    let text = std::fs::read_to_string(path)
                        .map_err(|e| io(format!("{}: {e}", path.display())))?;
                    serde_json::from_str::<TrainerState>(&text)
                        .map_err(|e| io(format!("{}: {e}", path.display())))?
                        .skipped_steps
                }
                None => 0,
            };
            Ok(Replica {
                step,
                params,
                optimizer: opt,
                skipped_steps,
                shard,
            })
        }
        InitialState::Memory { held, root_rank } => {
            // A sharded optimizer's shares are gathered again from the ranks that hold them.
            if let Some(plan) = &plan {
                return super::regather::regather(setup, layout, plan, held, root_rank, ring);
            }
            let is_root = setup.rank == root_rank;
            let mut replica = match held {
                Some(r) if r.step == step && r.shard.is_none() => r,
                other => {
                    if is_root {
                        return Err(TrainError::Data {
                            step,
                            message: format!(
                                "this rank was named to broadcast step {step} but holds {}",
                                other.map_or("nothing".to_string(), |r| format!("step {}", r.step))
                            ),
                        });
                    }
                    Replica {
                        step,
                        params: vec![0.0; layout.total_len()],
                        optimizer: fresh_optimizer(),
                        skipped_steps: 0,
                        shard: None,
                    }
                }
            };
            if setup.world_size > 1 {
                broadcast(ring, step, is_root, &mut replica).map_err(|source| {
                    TrainError::Broadcast {
                        step,
                        root: root_rank,
                        source,
                    }
                })?;
            }
            Ok(replica)
        }
    }
}
