//! The job's optimizer and learning-rate schedule, from the spec's `[train]` section.

use crate::optim::{
    AdamW, AdamWConfig, Diloco, DilocoConfig, Lamb, LambConfig, LrSchedule, Optimizer,
    ScheduleKind, ShardPlan,
};
use keel_proto::jobspec::{JobSpec, OptimizerKind, TrainSpec};
use keel_proto::params::ParamLayout;

/// The job's optimizer over `layout` (moments `[P]` each, hyper-parameters from `[train]`:
/// `adam_beta1`, `adam_beta2`, `adam_epsilon`, `weight_decay`; AdamW with bias correction),
/// inside DiLoCo's outer optimizer when the job has a `[diloco]` section.
pub fn optimizer_for(spec: &JobSpec, layout: &ParamLayout) -> Box<dyn Optimizer> {
    let inner = inner_optimizer(&spec.train, layout);
    match &spec.diloco {
        None => inner,
        Some(d) => Box::new(Diloco::new(
            inner,
            layout.total_len(),
            DilocoConfig {
                outer_lr: d.outer_learning_rate as f32,
                outer_momentum: d.outer_momentum as f32,
            },
        )),
    }
}

/// The `[train]` optimizer over this rank's chunks `plan` only (`train.shard_optimizer`,
/// ZeRO stage 1; never with `[diloco]`, which the spec refuses): moments `[plan.local_len()]`.
pub fn sharded_optimizer_for(spec: &JobSpec, plan: ShardPlan) -> Box<dyn Optimizer> {
    let t = &spec.train;
    match t.optimizer {
        OptimizerKind::Adamw => Box::new(AdamW::<f32>::with_plan(plan, adamw_config(t))),
        OptimizerKind::Lamb => Box::new(Lamb::<f32>::with_plan(plan, lamb_config(t))),
    }
}

/// `[train]`'s AdamW hyper-parameters (with bias correction).
fn adamw_config(t: &TrainSpec) -> AdamWConfig {
    AdamWConfig {
        beta1: t.adam_beta1,
        beta2: t.adam_beta2,
        eps: t.adam_epsilon,
        weight_decay: t.weight_decay,
        bias_correction: true,
    }
}

/// `[train]`'s LAMB hyper-parameters.
fn lamb_config(t: &TrainSpec) -> LambConfig {
    LambConfig {
        beta1: t.adam_beta1,
        beta2: t.adam_beta2,
        eps: t.adam_epsilon,
        weight_decay: t.weight_decay,
    }
}

/// The `[train]` optimizer alone.
fn inner_optimizer(t: &TrainSpec, layout: &ParamLayout) -> Box<dyn Optimizer> {
    match t.optimizer {
        OptimizerKind::Adamw => Box::new(AdamW::<f32>::new(layout, adamw_config(t))),
        OptimizerKind::Lamb => Box::new(Lamb::<f32>::new(layout, lamb_config(t))),
    }
}

/// The optimizer's name in `trainer_state.json` (`"adamw"`, `"lamb"`).
pub fn optimizer_name(kind: &OptimizerKind) -> &'static str {
    match kind {
        OptimizerKind::Adamw => "adamw",
        OptimizerKind::Lamb => "lamb",
    }
}

/// The job's learning-rate schedule: `warmup_steps` of linear warmup to `learning_rate`,
/// then `[train] schedule` down to 0 at `max_steps` (steps are 0-based optimizer steps).
pub fn schedule_for(t: &TrainSpec) -> LrSchedule {
    LrSchedule {
        kind: match t.schedule {
            keel_proto::jobspec::ScheduleKind::Linear => ScheduleKind::Linear,
            keel_proto::jobspec::ScheduleKind::Poly => ScheduleKind::Poly {
                power: t.poly_power,
            },
            keel_proto::jobspec::ScheduleKind::Constant => ScheduleKind::Constant,
        },
        peak_lr: t.learning_rate,
        warmup_steps: t.warmup_steps,
        total_steps: t.max_steps,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(train: &str) -> JobSpec {
        JobSpec::from_toml_str(&spec_text(train), "job.toml").unwrap()
    }

    fn spec_text(train: &str) -> String {
        format!(
            "[data]\ncorpus = [\"/corpus.txt\"]\nvocab_size = 1000\nmax_seq_length = 128\n\
             [model]\npreset = \"tiny\"\n[train]\nmicro_batch_size = 8\nmax_steps = 100\n{train}"
        )
    }

    #[test]
    fn the_schedule_follows_the_spec() {
        let t = spec(
            "learning_rate = 0.001\nwarmup_steps = 10\nschedule = \"poly\"\npoly_power = 2.0\n",
        )
        .train;
        let s = schedule_for(&t);
        assert_eq!(s.kind, ScheduleKind::Poly { power: 2.0 });
        assert_eq!((s.peak_lr, s.warmup_steps, s.total_steps), (0.001, 10, 100));
        let constant = schedule_for(&spec("schedule = \"constant\"\n").train);
        assert_eq!(constant.kind, ScheduleKind::Constant);
        assert_eq!(
            schedule_for(&spec("schedule = \"linear\"\n").train).kind,
            ScheduleKind::Linear
        );
    }

    #[test]
    fn the_optimizer_follows_the_spec() {
        let config = keel_proto::config::BertConfig::preset("tiny", 1000).unwrap();
        let layout = ParamLayout::bert(&config, config.heads());
        for (name, kind) in [
            ("adamw", OptimizerKind::Adamw),
            ("lamb", OptimizerKind::Lamb),
        ] {
            let job = spec(&format!("optimizer = \"{name}\"\n"));
            let t = &job.train;
            assert_eq!(t.optimizer, kind);
            assert_eq!(optimizer_name(&t.optimizer), name);
            let mut opt = optimizer_for(&job, &layout);
            assert!(opt.outer().is_none());
            assert_eq!(opt.steps_taken(), 0);
            for (_, state) in opt.state() {
                assert_eq!(state.len(), layout.total_len());
            }
        }
        // With [diloco], the same optimizer inside the outer one.
        let text = format!(
            "{}\n[diloco]\ninner_steps = 10\n",
            spec_text("optimizer = \"lamb\"\n")
        );
        let job = JobSpec::from_toml_str(&text, "job.toml").unwrap();
        let mut opt = optimizer_for(&job, &layout);
        assert!(opt.outer().is_some());
        let names: Vec<&str> = opt.state().iter().map(|(n, _)| *n).collect();
        assert_eq!(names.last(), Some(&"diloco_velocity"));
    }
}
