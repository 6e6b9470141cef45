//! Where a generation's starting state comes from (protocol steps 7 and 14): the job seed or
//! HF weights at step 0, a stored checkpoint, or this rank's held [`Replica`] plus a broadcast
//! from the root rank.

use super::error::{TrainError, io_err};
use super::optimizer::{optimizer_for, sharded_optimizer_for};
use super::setup::{InitialState, TrainSetup};
use crate::model::init_params;
use crate::optim::ShardPlan;
use crate::replica::{Replica, ShardOf, broadcast};
use crate::ringlink::RingLink;
use keel_proto::checkpoint::TrainerState;
use keel_proto::params::ParamLayout;

/// A start that failed, and what this rank held, handed back (boxed: both are large).
pub type Refused = Box<(TrainError, Option<Replica>)>;

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
) -> Result<Replica, Refused> {
    let initial = match initial {
        InitialState::Memory { held, root_rank } if plan.is_none() => (held, root_rank),
        other => {
            return from_elsewhere(other, setup, layout, plan, ring)
                .map_err(|e| Box::new((e, None)));
        }
    };
    {
        let (held, root_rank) = initial;
        let fresh = || Replica {
            step: setup.start_step,
            params: vec![0.0; layout.total_len()],
            optimizer: optimizer_for(&setup.spec, layout),
            skipped_steps: 0,
            shard: None,
        };
        let rank = (setup.rank, root_rank, setup.world_size);
        from_memory(held, setup.start_step, rank, fresh, |replica| {
            broadcast(ring, setup.start_step, setup.rank == root_rank, replica)
        })
    }
}

/// [`starting_replica`] from the seed, HF weights, a checkpoint, or (with a sharded optimizer)
/// the ranks' shares: nothing held is at stake.
fn from_elsewhere(
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
            // Unsharded: taken by `starting_replica` before this.
            let _ = (held, root_rank);
            unreachable!("an unsharded optimizer's state from memory is `from_memory`'s")
        }
    }
}

/// The held replica of `step` (or, on a rank that does not hold it, a `fresh` one to receive
/// into), made every rank's by `broadcast` from the root. `(rank, root_rank, world_size)`.
///
/// Errors: [`TrainError::Data`] when this rank is the root but does not hold `step`;
/// [`TrainError::Broadcast`] when the broadcast fails. Both hand back what this rank held,
/// untouched (the broadcast changes a replica only once every part has arrived): a survivor
/// that could not reach a newcomer keeps its state for the next generation.
fn from_memory(
    held: Option<Replica>,
    step: u64,
    (rank, root_rank, world_size): (u32, u32, u32),
    fresh: impl FnOnce() -> Replica,
    broadcast: impl FnOnce(&mut Replica) -> Result<(), crate::replica::BroadcastError>,
) -> Result<Replica, Refused> {
    let is_root = rank == root_rank;
    // The replica to broadcast from or receive into, and what this rank held of another step
    // (or nothing), kept aside while it receives.
    let (mut replica, other, held_step) = match held {
        Some(r) if r.step == step && r.shard.is_none() => (r, None, true),
        other if is_root => {
            let message = format!(
                "this rank was named to broadcast step {step} but holds {}",
                other
                    .as_ref()
                    .map_or("nothing".to_string(), |r| format!("step {}", r.step))
            );
            return Err(Box::new((TrainError::Data { step, message }, other)));
        }
        other => (fresh(), other, false),
    };
    if world_size > 1
        && let Err(source) = broadcast(&mut replica)
    {
        let error = TrainError::Broadcast {
            step,
            root: root_rank,
            source,
        };
        // The held replica of `step` comes back as it was; a fresh one is worth nothing.
        return Err(Box::new((
            error,
            if held_step { Some(replica) } else { other },
        )));
    }
    Ok(replica)
}

#[cfg(test)]
mod tests {
    use keel_proto::config::BertConfig;
    use keel_proto::params::ParamLayout;

    use super::{TrainError, from_memory};
    use crate::optim::{AdamW, AdamWConfig};
    use crate::replica::{BroadcastError, Replica};
    use crate::ringlink::RingLinkError;

    fn layout() -> ParamLayout {
        let config = BertConfig::preset("tiny", 100).expect("the tiny preset");
        ParamLayout::bert(&config, config.heads())
    }

    fn replica(step: u64, fill: f32) -> Replica {
        let layout = layout();
        Replica {
            step,
            params: vec![fill; layout.total_len()],
            optimizer: Box::new(AdamW::<f32>::new(&layout, AdamWConfig::default())),
            skipped_steps: 0,
            shard: None,
        }
    }

    fn ring_failed(_: &mut Replica) -> Result<(), BroadcastError> {
        Err(BroadcastError::Ring(RingLinkError::Closed))
    }

    /// The failing input of a recovery that lost steps: the survivor, named root for the step it
    /// holds, could not reach a replacement, and its broadcast failed. It must keep what it
    /// held (before, it reported holding nothing, and the job went back to its checkpoint).
    #[test]
    fn a_root_whose_broadcast_fails_keeps_its_replica() {
        let held = replica(25_637, 0.5);
        let fresh = || panic!("the root receives nothing");
        let Err(refused) = from_memory(Some(held), 25_637, (0, 0, 2), fresh, ring_failed) else {
            panic!("the broadcast failed")
        };
        let (e, back) = *refused;
        assert!(
            matches!(e, TrainError::Broadcast { step: 25_637, .. }),
            "{e}"
        );
        let back = back.expect("the held replica comes back");
        assert_eq!(back.step, 25_637);
        assert!(back.params.iter().all(|&x| x == 0.5));
    }

    /// A receiving rank that held the same step, or an older one, gets back what it held; one
    /// that held nothing gets nothing back (not the zeros it was receiving into).
    #[test]
    fn a_receiver_whose_broadcast_fails_keeps_what_it_held() {
        let fresh = || replica(9, 0.0);
        for (held, want) in [(Some(9), Some(9)), (Some(4), Some(4)), (None, None)] {
            let held = held.map(|step| replica(step, 0.25));
            let Err(refused) = from_memory(held, 9, (1, 0, 2), fresh, ring_failed) else {
                panic!("the broadcast failed")
            };
            let (_, back) = *refused;
            assert_eq!(back.as_ref().map(|r| r.step), want);
            if let Some(back) = back {
                assert!(back.params.iter().all(|&x| x == 0.25));
            }
        }
    }

    /// A root that does not hold the step refuses, and keeps what it held; a successful
    /// broadcast hands over the received replica.
    #[test]
    fn a_root_without_the_step_refuses_and_a_broadcast_that_works_is_taken() {
        let Err(refused) = from_memory(
            Some(replica(3, 1.0)),
            9,
            (0, 0, 2),
            || replica(9, 0.0),
            ring_failed,
        ) else {
            panic!("a root without the step")
        };
        let (e, back) = *refused;
        assert!(matches!(e, TrainError::Data { step: 9, .. }), "{e}");
        assert_eq!(back.map(|r| r.step), Some(3));
        let received = from_memory(
            None,
            9,
            (1, 0, 2),
            || replica(9, 0.0),
            |r: &mut Replica| {
                r.params.fill(2.0);
                Ok(())
            },
        )
        .unwrap_or_else(|_| panic!("the broadcast worked"));
        assert!(received.params.iter().all(|&x| x == 2.0));
    }
}
