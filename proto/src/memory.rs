//! How much memory training a BERT takes, computed with checked arithmetic so that no config,
//! however hostile, can wrap a product into a small number; and what a machine can give.
//!
//! # Layout
//! - [`MemoryEstimate`], [`estimate`]: parameters and bytes to train one rank;
//!   [`estimate_job`]: the same for a job's largest phase.
//! - [`machine_memory_limit`]: `/proc/meminfo` MemTotal, lowered by a cgroup limit.
//! - [`format_bytes`]: bytes as GiB/MiB for messages.

use crate::config::{BertConfig, ConfigError};
use crate::jobspec::JobSpec;

/// Bytes per stored value: weights, gradients, moments and activations are f32.
const F32: u64 = 4;

/// What training one rank of a model needs, in parameters and bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Trainable parameters (values), as [`crate::params::ParamLayout::bert`] lays them out.
    pub params: u64,
    /// Bytes of weights + gradients + the two optimizer moments: `16 * params`.
    pub state_bytes: u64,
    /// Bytes of activations kept for the backward pass of one micro-batch.
    pub activation_bytes: u64,
    /// `state_bytes + activation_bytes`.
    pub total_bytes: u64,
}

impl MemoryEstimate {
    /// The estimate for one of `ranks` ranks that share the optimizer moments
    /// (`train.shard_optimizer`, ZeRO stage 1): each keeps `ceil(1 / ranks)` of the two
    /// moments (`8 * params` bytes in all), weights, gradients and activations whole. One rank
    /// (or 0) changes nothing. Cannot overflow: it only lowers the estimate.
    pub fn with_moments_over(self, ranks: u64) -> MemoryEstimate {
        if ranks <= 1 {
            return self;
        }
        // `state_bytes` is `16 * params` (no overflow, checked when it was made).
        let moments = self.params.saturating_mul(2 * F32);
        let saved = moments - moments.div_ceil(ranks);
        MemoryEstimate {
            state_bytes: self.state_bytes - saved,
            total_bytes: self.total_bytes - saved,
            ..self
        }
    }
}

/// One checked step: `a * b` or `a + b`, naming `field` when it overflows 64 bits.
fn mul(a: u64, b: u64, field: &'static str) -> Result<u64, ConfigError> {
    a.checked_mul(b).ok_or_else(|| overflow(field))
}
fn add(a: u64, b: u64, field: &'static str) -> Result<u64, ConfigError> {
    a.checked_add(b).ok_or_else(|| overflow(field))
}
fn overflow(field: &'static str) -> ConfigError {
    ConfigError::InvalidField {
        field,
        reason: "the model's size overflows 64 bits with this value".to_string(),
    }
}

/// The memory to train `config` with `heads` on one rank, for micro-batches of
/// `micro_batch` sequences (`b`) of `seq_len` tokens (`t`; the job's `max_seq_length`).
///
/// With `c` hidden, `f` intermediate, `h` heads, `L` layers, `V` vocabulary, `P` positions,
/// `T` token types (all counts), every value an f32 (4 bytes):
/// - parameters `N = V c + P c + T c + 2c` (embeddings)
///   `+ L (4 (c c + c) + 2 (c f) + f + c + 4c)` (encoder layers)
///   `+ c c + c + 2c + V` (MLM head) `+ c c + c + 2c + 2` (pooler and NSP head, counted
///   always, so the estimate holds for both objectives);
/// - state `= 4 N` values: weights, gradients and the two Adam/LAMB moments (Loshchilov &
///   Hutter 2019; You et al. 2020 keep the same two moments);
/// - activations `= L (b t (12 c + 3 f) + 3 b h t t) + b t (4 c + 2 V)` values: per layer the
///   inputs of the six matmuls, the two LayerNorms and GELU (`12c + 3f` per token) and the
///   attention scores, probabilities and dropout mask (`3 t t` per head); then the embedding
///   output and the MLM logits with their gradient at every position (an upper bound: the
///   head only needs the masked ones);
/// - total bytes `= 4 (4 N + activations)`.
///
/// The sizes are not checked for sense (zero, divisibility): that is
/// [`BertConfig::validate`]'s job. Errors: [`ConfigError::InvalidField`] naming the field
/// whose product overflowed 64 bits (`micro_batch` is `train.micro_batch_size`, `seq_len`
/// is `data.max_seq_length`).
pub fn estimate(
    config: &BertConfig,
    micro_batch: usize,
    seq_len: usize,
) -> Result<MemoryEstimate, ConfigError> {
    let c = config.hidden_size as u64;
    let f = config.intermediate_size as u64;
    let h = config.num_attention_heads as u64;
    let l = config.num_hidden_layers as u64;
    let v = config.vocab_size as u64;
    let p = config.max_position_embeddings as u64;
    let tt = config.type_vocab_size as u64;
    let b = micro_batch as u64;
    let t = seq_len as u64;

    let cc = mul(c, c, "hidden_size")?;
    let cf = mul(c, f, "intermediate_size")?;
    // Embeddings.
    let mut emb = mul(v, c, "vocab_size")?;
    emb = add(
        emb,
        mul(p, c, "max_position_embeddings")?,
        "max_position_embeddings",
    )?;
    emb = add(emb, mul(tt, c, "type_vocab_size")?, "type_vocab_size")?;
    emb = add(emb, mul(2, c, "hidden_size")?, "hidden_size")?;
    // One encoder layer.
    let mut layer = mul(4, add(cc, c, "hidden_size")?, "hidden_size")?;
    layer = add(layer, mul(2, cf, "intermediate_size")?, "intermediate_size")?;
    layer = add(
        layer,
        add(f, mul(5, c, "hidden_size")?, "intermediate_size")?,
        "hidden_size",
    )?;
    // MLM head, pooler and NSP head.
    let heads = add(
        mul(
            2,
            add(cc, mul(3, c, "hidden_size")?, "hidden_size")?,
            "hidden_size",
        )?,
        add(v, 2, "vocab_size")?,
        "vocab_size",
    )?;
    // Each part is turned into bytes before it is multiplied by the layer count, so that an
    // overflow is charged to the factor that caused it.
    let state = |values: u64, field| mul(4 * F32, values, field);
    let params = add(
        add(emb, heads, "vocab_size")?,
        mul(l, layer, "num_hidden_layers")?,
        "num_hidden_layers",
    )?;
    let state_bytes = add(
        add(
            state(emb, "vocab_size")?,
            state(heads, "vocab_size")?,
            "vocab_size",
        )?,
        mul(l, state(layer, "hidden_size")?, "num_hidden_layers")?,
        "num_hidden_layers",
    )?;

    let bt = mul(b, t, "train.micro_batch_size")?;
    let per_token = add(
        mul(12, c, "hidden_size")?,
        mul(3, f, "intermediate_size")?,
        "intermediate_size",
    )?;
    let attention = mul(
        mul(3, mul(b, h, "num_attention_heads")?, "num_attention_heads")?,
        mul(t, t, "data.max_seq_length")?,
        "data.max_seq_length",
    )?;
    let layer_acts = add(
        mul(bt, per_token, "train.micro_batch_size")?,
        attention,
        "data.max_seq_length",
    )?;
    let head_acts = mul(
        bt,
        add(
            mul(4, c, "hidden_size")?,
            mul(2, v, "vocab_size")?,
            "vocab_size",
        )?,
        "vocab_size",
    )?;
    let activation_bytes = add(
        mul(
            l,
            mul(F32, layer_acts, "train.micro_batch_size")?,
            "num_hidden_layers",
        )?,
        mul(F32, head_acts, "vocab_size")?,
        "num_hidden_layers",
    )?;
    // Charged to the layer count when the per-layer terms dominate, to the vocabulary (the
    // embeddings and the MLM logits) otherwise.
    let layer_bytes =
        mul(l, state(layer, "hidden_size")?, "num_hidden_layers")?.saturating_add(mul(
            l,
            mul(F32, layer_acts, "train.micro_batch_size")?,
            "num_hidden_layers",
        )?);
    let field = if layer_bytes >= state_bytes.saturating_add(activation_bytes) / 2 {
        "num_hidden_layers"
    } else {
        "vocab_size"
    };
    let total_bytes = add(state_bytes, activation_bytes, field)?;
    Ok(MemoryEstimate {
        params,
        state_bytes,
        activation_bytes,
        total_bytes,
    })
}

/// The estimate for training `config` as `spec` says: its micro-batch at its
/// `max_seq_length`, the largest over the job's phases (a later `[[phase]]` may have longer
/// sequences); with `train.shard_optimizer`, for a rank of `cluster.min_workers` sharing the
/// moments (the job may run on as few).
///
/// # Errors
/// As [`estimate`]: [`ConfigError::InvalidField`] naming the field whose product overflows.
pub fn estimate_job(config: &BertConfig, spec: &JobSpec) -> Result<MemoryEstimate, ConfigError> {
    let per_rank = |p: usize| -> Result<MemoryEstimate, ConfigError> {
        let view = spec.phase_view(p);
        let e = estimate(
            config,
            view.train.micro_batch_size,
            view.data.max_seq_length,
        )?;
        Ok(if spec.train.shard_optimizer {
            e.with_moments_over(spec.cluster.min_workers as u64)
        } else {
            e
        })
    };
    // Phase 0 is the job itself; the first of equal estimates is kept.
    let mut largest = per_rank(0)?;
    for p in 1..spec.phase_count() {
        let e = per_rank(p)?;
        if e.total_bytes > largest.total_bytes {
            largest = e;
        }
    }
    Ok(largest)
}

/// The memory this machine can give a worker (bytes): `MemTotal` of `/proc/meminfo`, or the
/// cgroup's limit when it is lower (v2 `/sys/fs/cgroup/memory.max`, v1
/// `/sys/fs/cgroup/memory/memory.limit_in_bytes`). `None` when neither can be read (not Linux).
pub fn machine_memory_limit() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let total_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    let total = total_kib.saturating_mul(1024);
    let cgroup = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .filter_map(|p| std::fs::read_to_string(p).ok())
    // "max" (v2) or a huge number (v1) mean no limit; both parse to nothing lower.
    .filter_map(|s| s.trim().parse::<u64>().ok())
    .min();
    Some(cgroup.map_or(total, |c| c.min(total)))
}

/// `bytes` for a message: "22.0 TiB", "1.5 GiB", "300.0 MiB".
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharded_moments_leave_one_share_per_rank() {
        let config = BertConfig::preset("base", 30522).unwrap();
        let whole = estimate(&config, 8, 128).unwrap();
        assert_eq!(whole.with_moments_over(1), whole);
        let two = whole.with_moments_over(2);
        // Half of the 8 bytes per parameter of the two moments.
        assert_eq!(whole.total_bytes - two.total_bytes, 4 * whole.params);
        assert_eq!(whole.state_bytes - two.state_bytes, 4 * whole.params);
        assert_eq!(two.activation_bytes, whole.activation_bytes);
        let three = whole.with_moments_over(3);
        let moments = 8 * whole.params;
        assert_eq!(
            whole.state_bytes - three.state_bytes,
            moments - moments.div_ceil(3)
        );
    }
    use crate::params::{Heads, ParamLayout};

    /// The parameter count the estimate uses for `heads` without the heads it does not have,
    /// i.e. exactly [`crate::params::ParamLayout::bert`]'s `total_len` (for the test that pins
    /// the formula to the layout).
    fn layout_params(estimate: &MemoryEstimate, config: &BertConfig, heads: Heads) -> u64 {
        let c = config.hidden_size as u64;
        match heads {
            Heads::PreTraining => estimate.params,
            Heads::MaskedLm => estimate.params - (c * c + c + 2 * c + 2),
        }
    }

    #[test]
    fn the_parameter_count_is_the_layouts() {
        for name in ["tiny", "base", "large"] {
            let config = BertConfig::preset(name, 30522).unwrap();
            let e = estimate(&config, 8, 128).unwrap();
            for heads in [Heads::MaskedLm, Heads::PreTraining] {
                let layout = ParamLayout::bert(&config, heads);
                assert_eq!(
                    layout_params(&e, &config, heads),
                    layout.total_len() as u64,
                    "{name} {heads:?}"
                );
            }
            assert_eq!(e.state_bytes, 16 * e.params);
            assert_eq!(e.total_bytes, e.state_bytes + e.activation_bytes);
        }
        // BERT base is the well-known 110M parameters (Devlin et al. 2019, section 3).
        let base = estimate(&BertConfig::preset("base", 30522).unwrap(), 8, 128).unwrap();
        assert!(
            (109_000_000..111_000_000).contains(&base.params),
            "{}",
            base.params
        );
    }

    #[test]
    fn overflow_names_the_field_and_huge_models_are_huge() {
        let mut c = BertConfig::preset("tiny", 30522).unwrap();
        c.hidden_size = 1 << 62;
        match estimate(&c, 8, 128) {
            Err(ConfigError::InvalidField { field, .. }) => assert_eq!(field, "hidden_size"),
            other => panic!("{other:?}"),
        }
        let mut c = BertConfig::preset("tiny", 30522).unwrap();
        c.num_hidden_layers = 1 << 40;
        match estimate(&c, 8, 128) {
            Err(ConfigError::InvalidField { field, .. }) => {
                assert_eq!(field, "num_hidden_layers")
            }
            other => panic!("{other:?}"),
        }
        // The case: hidden 1,048,576 wants terabytes.
        let mut c = BertConfig::preset("tiny", 30522).unwrap();
        c.hidden_size = 1 << 20;
        c.intermediate_size = 4 << 20;
        let e = estimate(&c, 8, 128).unwrap();
        assert!(e.total_bytes > 1 << 40, "{}", format_bytes(e.total_bytes));
    }

    #[test]
    fn this_machine_has_a_limit() {
        let limit = machine_memory_limit().unwrap();
        assert!(limit > 1 << 20, "{limit}");
        assert_eq!(format_bytes(3 << 29), "1.5 GiB");
    }
}
