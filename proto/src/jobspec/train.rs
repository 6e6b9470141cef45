//! `[train]`: optimizer, schedule, arithmetic and checkpoints.

use super::error::SpecError;
use crate::precision::{AllReduceDtype, PrecisionSetting};
use serde::{Deserialize, Serialize};

/// Optimizer choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Adam with decoupled weight decay (Loshchilov & Hutter 2019).
    Adamw,
    /// LAMB (You et al. 2019, Algorithm 2).
    Lamb,
}

/// Learning-rate schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// Linear decay to 0 at `max_steps`.
    Linear,
    /// Polynomial decay (power `poly_power`) to 0 at `max_steps`.
    Poly,
    /// Constant after warmup.
    Constant,
}

/// `[train]`: optimisation settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSpec {
    /// Sequences per micro-batch on each worker.
    pub micro_batch_size: usize,
    /// Micro-batches per step on each worker; global batch = workers x micro_batch_size x this.
    #[serde(default = "default_one")]
    pub gradient_accumulation_steps: usize,
    /// Optimizer steps to run.
    pub max_steps: u64,
    /// `adamw` or `lamb`.
    #[serde(default = "default_optimizer")]
    pub optimizer: OptimizerKind,
    /// Peak learning rate.
    #[serde(default = "default_learning_rate")]
    pub learning_rate: f64,
    /// Steps of linear warmup from 0 to `learning_rate`.
    #[serde(default)]
    pub warmup_steps: u64,
    /// `linear`, `poly` or `constant`.
    #[serde(default = "default_schedule")]
    pub schedule: ScheduleKind,
    /// Power of the `poly` schedule.
    #[serde(default = "default_poly_power")]
    pub poly_power: f64,
    /// Decoupled weight decay, not applied to biases and LayerNorm.
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f64,
    /// Adam beta1.
    #[serde(default = "default_beta1")]
    pub adam_beta1: f64,
    /// Adam beta2.
    #[serde(default = "default_beta2")]
    pub adam_beta2: f64,
    /// Adam epsilon.
    #[serde(default = "default_eps")]
    pub adam_epsilon: f64,
    /// Global-norm gradient clipping; 0 = off.
    #[serde(default = "default_one_f64")]
    pub max_grad_norm: f64,
    /// Seed of initial weights, masking and dropout.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Write a checkpoint every this many steps (0 = only the final one).
    #[serde(default)]
    pub checkpoint_every: u64,
    /// Evaluate on the held-out sequences every this many steps (0 = only at the end).
    #[serde(default)]
    pub eval_every: u64,
    /// Keep this many periodic checkpoints (the final one is always kept).
    #[serde(default = "default_keep_checkpoints")]
    pub keep_checkpoints: usize,
    /// Steps whose loss or gradient is not finite are skipped (no update); after this many
    /// skipped steps the job fails.
    #[serde(default = "default_max_skipped_steps")]
    pub max_skipped_steps: u64,
    /// GEMM arithmetic: `auto` (default), `bf16` or `fp32` (see [`crate::precision`]).
    #[serde(default)]
    pub precision: PrecisionSetting,
    /// How gradients travel on the ring: `fp32` (default) or `bf16`, half the bytes, summed in
    /// fp32 at every hop (see [`AllReduceDtype`]).
    #[serde(default)]
    pub allreduce_dtype: AllReduceDtype,
    /// Gradient bucket size, MiB of fp32 (1 to 1024; default 4): each bucket is one ring
    /// all-reduce, started as soon as backward finishes it. Every bucket pays the ring's
    /// per-hop latency 2 (W - 1) times, so large worlds want larger buckets
    /// (`scripts/scale_model.py`); small ones overlap more of the all-reduce with backward.
    #[serde(default = "default_bucket_mib")]
    pub bucket_mib: usize,
    /// ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO", section 5.1, P_os): each of the W ranks
    /// keeps the optimizer moments of 1/W of the parameters and updates only those. The
    /// gradient all-reduce becomes a reduce-scatter, and the updated weights an all-gather:
    /// the same bytes on the wire, 2/W of the moments' memory and 1/W of the optimizer's time
    /// per rank. Checkpoints gather the moments. A lost worker takes its moments with it, so a
    /// job with this set recovers from its newest checkpoint (as DeepSpeed does), not from
    /// the survivors' memory. Not with `[diloco]`. Default false.
    #[serde(default)]
    pub shard_optimizer: bool,
}

fn default_one() -> usize {
    1
}
fn default_one_f64() -> f64 {
    1.0
}
fn default_optimizer() -> OptimizerKind {
    OptimizerKind::Adamw
}
fn default_learning_rate() -> f64 {
    1e-4
}
fn default_schedule() -> ScheduleKind {
    ScheduleKind::Linear
}
fn default_poly_power() -> f64 {
    1.0
}
fn default_weight_decay() -> f64 {
    0.01
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_eps() -> f64 {
    1e-6
}
fn default_seed() -> u64 {
    42
}
fn default_keep_checkpoints() -> usize {
    3
}
fn default_max_skipped_steps() -> u64 {
    10
}
fn default_bucket_mib() -> usize {
    4
}

impl TrainSpec {
    /// Checks every `[train]` value on its own. What `[diloco]` or `[[phase]]` asks of it is
    /// a rule across sections (`JobSpec::validate`).
    ///
    /// Errors: the first [`SpecError`], naming the key.
    pub fn validate(&self) -> Result<(), SpecError> {
        let t = self;
        if t.micro_batch_size == 0 || t.micro_batch_size > 65_536 {
            return Err(SpecError::new(
                "train.micro_batch_size",
                t.micro_batch_size.to_string(),
                "between 1 and 65536 sequences",
            ));
        }
        if t.gradient_accumulation_steps == 0 || t.gradient_accumulation_steps > 65_536 {
            return Err(SpecError::new(
                "train.gradient_accumulation_steps",
                t.gradient_accumulation_steps.to_string(),
                "between 1 and 65536",
            ));
        }
        if t.max_steps == 0 {
            return Err(SpecError::new("train.max_steps", "0", "at least 1 step"));
        }
        if !(t.learning_rate.is_finite() && t.learning_rate > 0.0 && t.learning_rate < 10.0) {
            return Err(SpecError::new(
                "train.learning_rate",
                t.learning_rate.to_string(),
                "a positive number below 10",
            ));
        }
        if t.warmup_steps > t.max_steps {
            return Err(SpecError::new(
                "train.warmup_steps",
                t.warmup_steps.to_string(),
                "at most train.max_steps",
            ));
        }
        if !(t.poly_power.is_finite() && t.poly_power > 0.0) {
            return Err(SpecError::new(
                "train.poly_power",
                t.poly_power.to_string(),
                "a positive number",
            ));
        }
        if !(t.weight_decay.is_finite() && (0.0..1.0).contains(&t.weight_decay)) {
            return Err(SpecError::new(
                "train.weight_decay",
                t.weight_decay.to_string(),
                "a number in [0, 1)",
            ));
        }
        for (key, v) in [
            ("train.adam_beta1", t.adam_beta1),
            ("train.adam_beta2", t.adam_beta2),
        ] {
            if !(0.0..1.0).contains(&v) {
                return Err(SpecError::new(key, v.to_string(), "a number in [0, 1)"));
            }
        }
        if !(t.adam_epsilon.is_finite() && t.adam_epsilon > 0.0) {
            return Err(SpecError::new(
                "train.adam_epsilon",
                t.adam_epsilon.to_string(),
                "a positive number",
            ));
        }
        if !(t.max_grad_norm.is_finite() && t.max_grad_norm >= 0.0) {
            return Err(SpecError::new(
                "train.max_grad_norm",
                t.max_grad_norm.to_string(),
                "a number >= 0 (0 turns clipping off)",
            ));
        }
        if t.keep_checkpoints == 0 {
            return Err(SpecError::new(
                "train.keep_checkpoints",
                "0",
                "at least 1 checkpoint",
            ));
        }
        if !(1..=1024).contains(&t.bucket_mib) {
            return Err(SpecError::new(
                "train.bucket_mib",
                t.bucket_mib.to_string(),
                "1 to 1024 MiB",
            ));
        }
        Ok(())
    }
}
