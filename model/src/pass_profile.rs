//! Where a training step's time goes, pass by pass: the step's roofline.
//!
//! Every pass over memory (LayerNorm, the activation, dropout, the bf16 casts, the optimizer,
//! ...) and every GEMM opens a region with the bytes it reads and writes (and, for a GEMM,
//! its flops). A region's time is *exclusive*: time spent in a region opened inside it (a cast
//! inside a GEMM, a LayerNorm inside the embeddings) is counted for the inner one only, so the
//! regions of a step add up to at most the step, and what is left is work no region names.
//!
//! Only the thread that runs the step records (the model's helper threads run the other parts
//! of a split, at the same time): a region's time is the step's wall time spent in it. With
//! several threads, the step thread's wait for the helpers after its own part is the region
//! [`Pass::Join`]: the imbalance and hand-off cost of the split.
//!
//! Bytes are what the pass must move at the least (each operand read once, each output written
//! once), so `bytes / seconds` held against the machine's copy bandwidth says how far a pass is
//! from the memory limit. Counting costs two clock reads per region (a few hundred per step).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The passes a step is cut into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// GEMMs of the Linears (projections, FFN, MLM transform): `super::linear`.
    GemmLinear,
    /// Attention's batched GEMMs (`Q K^T`, `P V` and their gradients).
    GemmAttention,
    /// The tied MLM decoder's GEMMs (`[m, c] x [c, v]`).
    GemmMlmHead,
    /// Any other GEMM.
    GemmOther,
    /// f32 to bf16 casts of GEMM operands (`super::bf16_convert`).
    Bf16Cast,
    /// Attention apart from its GEMMs: mask, softmax, dropout and their backward.
    AttentionElementwise,
    /// LayerNorm forward (with its residual add).
    LayerNormForward,
    /// LayerNorm backward.
    LayerNormBackward,
    /// GELU (or ReLU) forward.
    ActivationForward,
    /// GELU (or ReLU) backward.
    ActivationBackward,
    /// Hidden-state dropout, forward and backward (the same mask applied).
    Dropout,
    /// A Linear's bias gradient (`db += sum_n dy`).
    BiasGradient,
    /// Embedding lookups and their gradient scatter (their LayerNorm is its own region).
    Embeddings,
    /// Scatter and gather between the unpadded rows and attention's padded layout.
    Packing,
    /// The MLM and NSP losses: softmax over the vocabulary, cross-entropy and its gradient.
    Loss,
    /// Setting the gradient buffer to zero before the backward.
    ZeroGradients,
    /// Gradient clipping (the global norm and the scaling).
    ClipGradients,
    /// The optimizer's update over all parameters (AdamW or LAMB).
    Optimizer,
    /// The step thread waiting for the model's helper threads after its own part of a split.
    Join,
}

impl Pass {
    /// Every pass, in table order.
    pub const ALL: [Pass; 19] = [
        Pass::GemmLinear,
        Pass::GemmAttention,
        Pass::GemmMlmHead,
        Pass::GemmOther,
        Pass::Bf16Cast,
        Pass::AttentionElementwise,
        Pass::LayerNormForward,
        Pass::LayerNormBackward,
        Pass::ActivationForward,
        Pass::ActivationBackward,
        Pass::Dropout,
        Pass::BiasGradient,
        Pass::Embeddings,
        Pass::Packing,
        Pass::Loss,
        Pass::ZeroGradients,
        Pass::ClipGradients,
        Pass::Optimizer,
        Pass::Join,
    ];

    /// The name the bench prints.
    pub fn name(self) -> &'static str {
        match self {
            Pass::GemmLinear => "gemm_linear",
            Pass::GemmAttention => "gemm_attention",
            Pass::GemmMlmHead => "gemm_mlm_head",
            Pass::GemmOther => "gemm_other",
            Pass::Bf16Cast => "bf16_cast",
            Pass::AttentionElementwise => "attention_softmax_mask_dropout",
            Pass::LayerNormForward => "layernorm_forward",
            Pass::LayerNormBackward => "layernorm_backward",
            Pass::ActivationForward => "activation_forward",
            Pass::ActivationBackward => "activation_backward",
            Pass::Dropout => "hidden_dropout",
            Pass::BiasGradient => "bias_gradient",
            Pass::Embeddings => "embeddings",
            Pass::Packing => "packing",
            Pass::Loss => "loss",
            Pass::ZeroGradients => "zero_gradients",
            Pass::ClipGradients => "clip_gradients",
            Pass::Optimizer => "optimizer",
            Pass::Join => "join_wait",
        }
    }

    /// True for the GEMM regions (held against a flop rate, not a bandwidth).
    pub fn is_gemm(self) -> bool {
        matches!(
            self,
            Pass::GemmLinear | Pass::GemmAttention | Pass::GemmMlmHead | Pass::GemmOther
        )
    }

    fn index(self) -> usize {
        self as usize
    }
}

const N: usize = Pass::ALL.len();

#[allow(clippy::declare_interior_mutable_const)] // only used to initialise the arrays below
const ZERO: AtomicU64 = AtomicU64::new(0);
static CALLS: [AtomicU64; N] = [ZERO; N];
static NANOS: [AtomicU64; N] = [ZERO; N];
static READ: [AtomicU64; N] = [ZERO; N];
static WRITTEN: [AtomicU64; N] = [ZERO; N];
static FLOPS: [AtomicU64; N] = [ZERO; N];
/// [`Pass::Join`]'s nanoseconds by the pass whose split it waited for.
static JOIN_BY_PASS: [AtomicU64; N] = [ZERO; N];

/// Marks this thread as one of the model's helper threads (called by the pool's start handler).
pub fn mark_helper_thread() {
    crate::thread_state::mark_helper();
}

/// One pass while it runs; its exclusive time is recorded when it is dropped.
#[must_use = "the region is timed until it is dropped"]
pub struct Region {
    pass: Pass,
    /// `None` on a helper thread: nothing is recorded.
    start: Option<Instant>,
    /// The enclosing region's inner time, put back (plus this region's) on drop.
    outer_inner: u64,
    /// The enclosing region's pass, open again after this one (`None`: none was open).
    outer_pass: Option<Pass>,
}

/// Opens a region of `pass` that reads `read` and writes `written` bytes.
pub fn region(pass: Pass, read: usize, written: usize) -> Region {
    gemm_region(pass, read, written, 0)
}

/// [`region`] for a GEMM of `flops` floating-point operations.
pub fn gemm_region(pass: Pass, read: usize, written: usize, flops: usize) -> Region {
    if crate::thread_state::is_helper() {
        return Region {
            pass,
            start: None,
            outer_inner: 0,
            outer_pass: None,
        };
    }
    let i = pass.index();
    CALLS[i].fetch_add(1, Ordering::Relaxed);
    READ[i].fetch_add(read as u64, Ordering::Relaxed);
    WRITTEN[i].fetch_add(written as u64, Ordering::Relaxed);
    FLOPS[i].fetch_add(flops as u64, Ordering::Relaxed);
    Region {
        pass,
        start: Some(Instant::now()),
        outer_inner: crate::thread_state::replace_inner_nanos(0),
        outer_pass: crate::thread_state::replace_open_pass(Some(pass.index()))
            .and_then(|i| Pass::ALL.get(i).copied()),
    }
}

impl Region {
    /// Records the region and returns its exclusive time (nanoseconds; 0 on a helper thread
    /// or when already finished).
    fn finish(&mut self) -> u64 {
        let Some(start) = self.start.take() else {
            return 0;
        };
        let elapsed = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let exclusive = elapsed.saturating_sub(crate::thread_state::inner_nanos());
        NANOS[self.pass.index()].fetch_add(exclusive, Ordering::Relaxed);
        if self.pass == Pass::Join {
            // A join outside any region is counted under its own pass, as before.
            let outer = self.outer_pass.unwrap_or(Pass::Join);
            JOIN_BY_PASS[outer.index()].fetch_add(exclusive, Ordering::Relaxed);
        }
        crate::thread_state::replace_inner_nanos(self.outer_inner.saturating_add(elapsed));
        crate::thread_state::replace_open_pass(self.outer_pass.map(Pass::index));
        exclusive
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.finish();
    }
}

/// One pass's totals since the last [`reset`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PassTotals {
    /// Which pass.
    pub pass: Pass,
    /// Regions opened.
    pub calls: u64,
    /// Exclusive wall time on the step thread (seconds).
    pub seconds: f64,
    /// Bytes read at the least.
    pub bytes_read: u64,
    /// Bytes written at the least.
    pub bytes_written: u64,
    /// Floating-point operations (GEMMs only; 0 elsewhere).
    pub flops: u64,
    /// Seconds the step thread waited for the helpers in this pass's splits (counted in
    /// [`Pass::Join`]'s `seconds`, not in this pass's).
    pub join_seconds: f64,
}

/// Every pass's totals, in [`Pass::ALL`] order.
pub fn totals() -> Vec<PassTotals> {
    Pass::ALL
        .iter()
        .map(|&pass| {
            let i = pass.index();
            PassTotals {
                pass,
                calls: CALLS[i].load(Ordering::Relaxed),
                seconds: NANOS[i].load(Ordering::Relaxed) as f64 * 1e-9,
                bytes_read: READ[i].load(Ordering::Relaxed),
                bytes_written: WRITTEN[i].load(Ordering::Relaxed),
                flops: FLOPS[i].load(Ordering::Relaxed),
                join_seconds: JOIN_BY_PASS[i].load(Ordering::Relaxed) as f64 * 1e-9,
            }
        })
        .collect()
}

/// Sets every total back to zero.
pub fn reset() {
    for counters in [&CALLS, &NANOS, &READ, &WRITTEN, &FLOPS, &JOIN_BY_PASS] {
        for c in counters {
            c.store(0, Ordering::Relaxed);
        }
    }
}

/// Bytes of `n` elements of `A`.
pub fn bytes<A>(n: usize) -> usize {
    n * std::mem::size_of::<A>()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin(ms: u64) {
        let start = Instant::now();
        while start.elapsed() < std::time::Duration::from_millis(ms) {
            std::hint::spin_loop();
        }
    }

    /// An inner region's time is taken out of the outer one's, and the two add up to the
    /// outer region's wall time; a region after them starts from zero again.
    #[test]
    fn inner_time_is_counted_once() {
        let started = Instant::now();
        let mut outer = region(Pass::ClipGradients, 10, 20);
        spin(20);
        let mut inner = region(Pass::ZeroGradients, 1, 2);
        spin(30);
        let inner_ns = inner.finish();
        spin(10);
        let outer_ns = outer.finish();
        let wall = u64::try_from(started.elapsed().as_nanos()).expect("short");
        assert!(inner_ns >= 30_000_000, "inner {inner_ns}");
        assert!(
            (30_000_000..45_000_000).contains(&outer_ns),
            "outer {outer_ns}: exclusive of the inner 30 ms"
        );
        assert!(
            outer_ns + inner_ns <= wall,
            "{outer_ns} + {inner_ns} > {wall}"
        );
        assert_eq!(outer.finish(), 0, "finished once");
        let mut next = region(Pass::ClipGradients, 0, 0);
        spin(5);
        let next_ns = next.finish();
        assert!((5_000_000..15_000_000).contains(&next_ns), "next {next_ns}");
    }

    /// A helper thread records nothing; any other thread does.
    #[test]
    fn helper_threads_do_not_record() {
        let helper = std::thread::spawn(|| {
            mark_helper_thread();
            region(Pass::Join, 1, 1).start.is_some()
        });
        assert!(
            !helper.join().expect("thread ran"),
            "a helper's region is not timed"
        );
        let plain = std::thread::spawn(|| region(Pass::Join, 1, 1).start.is_some());
        assert!(
            plain.join().expect("thread ran"),
            "the step thread's region is timed"
        );
    }
}
