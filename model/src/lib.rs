//! BERT forward and backward on the CPU, exactly as Hugging Face computes them.
//!
//! Matches HF `BertForMaskedLM` and `BertForPreTraining` (post-LayerNorm encoder, Devlin et al.
//! 2019; Vaswani et al. 2017 for the attention), in f32 for training and f64 for the checks.
//!
//! Shape legend used in every file: `b` batch (sequences), `t` sequence length (tokens, padded),
//! `n` token rows (`b * t`, or fewer when padding is left out: `packing`), `c` hidden size,
//! `f` intermediate size, `h` heads, `d` head size (`c / h`), `m` masked positions, `v`
//! vocabulary size.
//!
//! # Layout
//! - `element`: the scalar trait ([`Element`], implemented for f32 and f64); its `as_f32` is
//!   the one way the model asks what its element type is.
//! - `gemms`: how a model's GEMMs run, as a value (`Gemms`: fp32 or bf16, native or not), made
//!   once by [`Bert`] and passed with every layer call; attention's route follows from it.
//! - `gemm`: the matrix-multiply entry points, counted per `GemmSite` for the bench;
//!   `gemm_split` cuts a GEMM among the model's threads, `gemm_ksplit` along its sum.
//! - `bf16`, `bf16_convert`, `bf16_cpu`, `bf16_shared`, `onednn`: the bf16 routes of those
//!   entry points (inputs rounded to bf16, fp32 accumulation), the rounding, the probe for
//!   native bf16 (AMX, or AVX512_BF16 raced against fp32), operands that carry their bf16 copy
//!   (rounded once for several GEMMs: `Operand`, `Flat`), and oneDNN's matmul behind a C shim.
//! - One file per layer, each a forward/backward pair side by side: `linear`, `layernorm`,
//!   `activation` (GELU, tanh-GELU, ReLU), `dropout`, `attention`, `embeddings`,
//!   `encoder_layer`, `mlm_head`, `nsp_head`, `loss` (cross-entropy). Attention's two routes
//!   (`attention`, `attention_batched`) share `attention_dims` and `softmax`.
//! - `pass_profile`: the step's time and bytes per pass, for the bench's roofline table.
//! - `packing`: the rows a batch is computed on: only the real tokens', padding left out
//!   (attention's operands scattered into the padded layout and back).
//! - `bert`: the whole model ([`Bert`]) over one flat parameter buffer (its children:
//!   `bert_inputs`, the checks of a batch; `bert_eval`, the eval forwards).
//! - `init`: HF's `_init_weights` ([`init_params`]).
//! - `lookup_grads`: the word embeddings' lookup share of the gradient, kept apart from the
//!   tied decoder's share so the latter can be all-reduced early ([`LookupGrads`]).
//! - `batch`: the micro-batch type the data pipeline makes and the model reads.
//! - `parallel`: the model's thread pool and its fixed-order splits; `thread_state`: what
//!   belongs to one thread of that pool (reused scratch, the part mark, the profile's nesting),
//!   none of it a choice of what is computed.
//!
//! A crate of its own so that a program that only runs the model (`keel fill-mask`) does not
//! link the worker's ring, gRPC services and training loop.

#![warn(missing_docs)]

// Link OpenBLAS (Debian's system library) as ndarray's BLAS backend.
extern crate blas_src;

mod activation;
mod attention;
mod attention_batched;
mod attention_dims;
pub mod batch;
mod bert;
pub mod bf16;
mod bf16_convert;
mod bf16_cpu;
#[cfg(test)]
mod bf16_gemm_tests;
#[cfg(test)]
mod bf16_kept_tests;
mod bf16_shared;
mod dropout;
mod element;
mod embeddings;
mod encoder_layer;
pub mod gemm;
mod gemm_ksplit;
mod gemm_split;
mod gemms;
#[cfg(test)]
mod gradcheck;
mod init;
mod layernorm;
mod linear;
mod lookup_grads;
mod loss;
mod mlm_head;
mod nsp_head;
mod onednn;
mod packing;
pub mod parallel;
pub mod pass_profile;
mod softmax;
mod thread_state;
mod vmath;

pub use bert::{Bert, ForwardOutputs};
pub use dropout::DropoutKey;
pub use element::Element;
pub use init::init_params;
pub use lookup_grads::LookupGrads;
pub use onednn::Strided4;
pub use packing::DEFAULT_ROW_MULTIPLE as UNPAD_ROW_MULTIPLE;

/// Errors of running the model on a batch.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model config is invalid.
    #[error(transparent)]
    Config(#[from] keel_proto::config::ConfigError),
    /// A flat buffer (parameters or gradients) does not have the layout's length.
    #[error("{buffer} buffer has {got} elements, the parameter layout {expected}")]
    BufferLength {
        /// `params` or `grads`.
        buffer: &'static str,
        /// `ParamLayout::total_len()`.
        expected: usize,
        /// Length passed.
        got: usize,
    },
    /// A batch field has the wrong shape.
    #[error("batch field `{field}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The `Batch` field.
        field: &'static str,
        /// The shape wanted.
        expected: Vec<usize>,
        /// The shape found.
        got: Vec<usize>,
    },
    /// The padded sequence is longer than `max_position_embeddings`.
    #[error("sequence length {seq_len} exceeds max_position_embeddings {max}")]
    SequenceTooLong {
        /// `t` (tokens).
        seq_len: usize,
        /// The config's `max_position_embeddings`.
        max: usize,
    },
    /// An id is outside its table (vocabulary, token types, NSP classes, flat positions).
    #[error("batch field `{field}`[{index}] = {value} is out of range (must be < {limit})")]
    OutOfRange {
        /// The `Batch` field.
        field: &'static str,
        /// Flat index within the field.
        index: usize,
        /// The offending value.
        value: usize,
        /// The exclusive upper bound.
        limit: usize,
    },
    /// A batch array is not in standard (row-major, contiguous) layout.
    #[error("batch field `{field}` is not a contiguous row-major array")]
    NotContiguous {
        /// The `Batch` field.
        field: &'static str,
    },
    /// A token of the batch has no row in the [`LookupGrads`] given to
    /// [`Bert::forward_backward_split_lookup`] (its presence vector missed this batch).
    #[error("token id {token_id} of the batch has no row in the lookup gradient")]
    LookupRowMissing {
        /// The token id.
        token_id: u32,
    },
    /// A PreTraining model was given a batch without next-sentence labels.
    #[error("BertForPreTraining needs next_sentence_labels in the batch")]
    MissingNextSentenceLabels,
}

/// How one training step runs.
#[derive(Debug, Clone, Copy)]
pub struct StepOptions<A> {
    /// Factor on the summed MLM loss whose gradient is taken (e.g. 1 / global masked count).
    pub mlm_scale: A,
    /// Factor on the summed NSP loss whose gradient is taken (e.g. 1 / global batch size).
    pub nsp_scale: A,
    /// `Some` = training mode with reproducible dropout; `None` = eval mode (no dropout).
    pub dropout: Option<DropoutKey>,
    /// Call `on_grad_ready` as ranges of the gradient buffer become final.
    pub report_ready: bool,
}

/// Summed losses and counts of a batch (sums, so that data-parallel workers can all-reduce
/// them and divide by global counts).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LossSums<A> {
    /// Sum over masked tokens of the MLM cross-entropy (nats).
    pub mlm_loss_sum: A,
    /// Number of masked tokens `m`.
    pub mlm_count: usize,
    /// Masked tokens whose argmax prediction is the label.
    pub mlm_correct: usize,
    /// Sum over sequences of the NSP cross-entropy (nats); 0 without the NSP head.
    pub nsp_loss_sum: A,
    /// Number of sequences with an NSP label (0 without the NSP head).
    pub nsp_count: usize,
    /// Sequences whose argmax NSP prediction is the label.
    pub nsp_correct: usize,
}

/// Sets the number of threads the model uses (process-wide): large GEMMs are cut among
/// them, each part a single-threaded OpenBLAS call, as are attention and elementwise work.
pub fn set_blas_threads(n: usize) {
    parallel::set_threads(n);
}

/// The backend bf16 GEMMs take in this process for a job in `precision`: `fp32`,
/// `bf16-native` (oneDNN) or `bf16-emulated`; for logs.
pub fn bf16_backend_name(precision: keel_proto::precision::Precision) -> &'static str {
    match (precision, bf16::backend()) {
        (keel_proto::precision::Precision::Fp32, _) => "fp32",
        (_, bf16::Bf16Backend::Native) => "bf16-native",
        (_, bf16::Bf16Backend::Emulated) => "bf16-emulated",
    }
}

/// The thread count set by [`set_blas_threads`] (1 by default).
pub fn threads() -> usize {
    parallel::threads()
}
