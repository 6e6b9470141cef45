//! The world-size-invariant data plan: which sequences each rank trains on at each step.
//!
//! Definitions (`N` training sequences, world size `W`, micro-batch size `b`, gradient
//! accumulation steps `k`):
//! - The epoch order is the training sequences in manifest order, global index `0..N`
//!   (prepare already shuffled them once, with its seed).
//! - Global batch `B = W * b * k`; `steps_per_epoch = floor(N / B)` (the last `N mod B`
//!   sequences are not used in that epoch; an error if `steps_per_epoch` would be 0).
//! - At global step `s`: epoch `e = s / steps_per_epoch`, position `p = s % steps_per_epoch`;
//!   the global batch is sequences `[p*B, (p+1)*B)`.
//! - Rank `r` takes rows `[r*b*k, (r+1)*b*k)` of it; its micro-batch `j` (0..k) is rows
//!   `[r*b*k + j*b, r*b*k + (j+1)*b)`.
//! - After a recovery the job keeps its first `B` whatever the new `W`
//!   ([`WorkerPlan::with_global_batch`]): rank `r` takes rows `[floor(r*B/W), floor((r+1)*B/W))`
//!   in micro-batches of at most `b` rows.
//! - The sample id of a row (keys dropout) is `s * B + row`, `row` its position in the global
//!   batch: the same sample gets the same id whatever `W`, `b`, `k` split `B`.
//!
//! So for a fixed `B` the union over ranks of a step's micro-batches is the same set of
//! sequences with the same sample ids, whatever the world size.
//!
//! # Layout
//! - [`WorkerPlan`]: one rank's view of the plan.
//! - [`MicroBatchPlan`]: the sequences and sample ids of one micro-batch.
//! - [`SplitError`]: invalid plans.

/// Errors building a plan.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// A size that must be positive is zero.
    #[error("{field} must be at least 1")]
    Zero {
        /// The offending field.
        field: &'static str,
    },
    /// The rank is not below the world size.
    #[error("rank {rank} is out of range for world size {world_size}")]
    RankOutOfRange {
        /// The rank.
        rank: u32,
        /// The world size.
        world_size: u32,
    },
    /// Fewer training sequences than one global batch.
    #[error(
        "corpus too small for the global batch: {total_sequences} training sequences, one global \
         batch (world_size {world_size} x micro_batch_size {micro_batch_size} x \
         gradient_accumulation_steps {grad_accum}) needs {global_batch}, {missing} more"
    )]
    CorpusTooSmall {
        /// Training sequences available.
        total_sequences: u64,
        /// Sequences per global batch.
        global_batch: u64,
        /// How many are missing.
        missing: u64,
        /// World size.
        world_size: u32,
        /// Micro-batch size.
        micro_batch_size: u32,
        /// Gradient accumulation steps.
        grad_accum: u32,
    },
    /// `micro_batch(step, j)` with `j >= k`.
    #[error("micro-batch {j} requested, gradient accumulation has {grad_accum}")]
    MicroBatchOutOfRange {
        /// The micro-batch index asked for.
        j: u32,
        /// Gradient accumulation steps `k`.
        grad_accum: u32,
    },
}

/// One micro-batch of one rank at one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MicroBatchPlan {
    /// The epoch this step falls in (keys dynamic masking).
    pub epoch: u64,
    /// Global sequence indices of the rows, `[b]`.
    pub sequence_indices: Vec<u64>,
    /// Global sample ids of the rows, `[b]` (keys dropout).
    pub sample_ids: Vec<u64>,
}

/// One rank's share of the data plan (see the module docs for the definition).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerPlan {
    /// Training sequences `N`.
    total_sequences: u64,
    /// World size `W`.
    world_size: u32,
    /// This rank `r`.
    rank: u32,
    /// Micro-batch size `b` (sequences).
    micro_batch_size: u32,
    /// Global batch `B` (sequences per optimizer step).
    global_batch: u64,
}

impl WorkerPlan {
    /// The plan of `rank` among `world_size` ranks over `total_sequences` training sequences,
    /// with global batch `B = W * b * k`.
    ///
    /// Errors: `Zero` (any size 0), `RankOutOfRange`, `CorpusTooSmall` (fewer sequences than
    /// one global batch, saying how many are missing).
    pub fn new(
        total_sequences: u64,
        world_size: u32,
        rank: u32,
        micro_batch_size: u32,
        grad_accum: u32,
    ) -> Result<WorkerPlan, SplitError> {
        if grad_accum == 0 {
            return Err(SplitError::Zero {
                field: "gradient_accumulation_steps",
            });
        }
        let global = u64::from(world_size) * u64::from(micro_batch_size) * u64::from(grad_accum);
        Self::with_global_batch(total_sequences, global, world_size, rank, micro_batch_size)
    }

    /// The plan of `rank` among `world_size` ranks with a given global batch `B` (sequences
    /// per step), as after a recovery: the job keeps the `B` of its first generation, and a
    /// smaller (or larger) world splits the same rows differently. Rank `r` takes rows
    /// `[floor(r*B/W), floor((r+1)*B/W))`, in micro-batches of `b` rows (the last one may be
    /// shorter). With `B = W * b * k` this is exactly [`WorkerPlan::new`].
    ///
    /// Errors: `Zero` (any size 0, or `B < W`: a rank with no rows), `RankOutOfRange`,
    /// `CorpusTooSmall`.
    pub fn with_global_batch(
        total_sequences: u64,
        global_batch: u64,
        world_size: u32,
        rank: u32,
        micro_batch_size: u32,
    ) -> Result<WorkerPlan, SplitError> {
        for (field, v) in [
            ("world_size", u64::from(world_size)),
            ("micro_batch_size", u64::from(micro_batch_size)),
            ("global_batch_size", global_batch),
        ] {
            if v == 0 {
                return Err(SplitError::Zero { field });
            }
        }
        if global_batch < u64::from(world_size) {
            return Err(SplitError::Zero {
                field: "rows per rank (global batch smaller than the world size)",
            });
        }
        if rank >= world_size {
            return Err(SplitError::RankOutOfRange { rank, world_size });
        }
        let plan = WorkerPlan {
            total_sequences,
            world_size,
            rank,
            micro_batch_size,
            global_batch,
        };
        if total_sequences < global_batch {
            return Err(SplitError::CorpusTooSmall {
                total_sequences,
                global_batch,
                missing: global_batch - total_sequences,
                world_size,
                micro_batch_size,
                grad_accum: plan.grad_accum(),
            });
        }
        Ok(plan)
    }

    /// Global batch `B` (sequences per optimizer step).
    pub fn global_batch_size(&self) -> u64 {
        self.global_batch
    }

    /// This rank's rows of the global batch, `[first, end)`.
    fn rows(&self) -> (u64, u64) {
        let w = u64::from(self.world_size);
        let r = u64::from(self.rank);
        (r * self.global_batch / w, (r + 1) * self.global_batch / w)
    }

    /// Rows of the global batch this rank processes per step (`b * k` when `B = W * b * k`).
    pub fn rows_per_rank(&self) -> u64 {
        let (first, end) = self.rows();
        end - first
    }

    /// Optimizer steps per epoch, `floor(N / B)` (at least 1).
    pub fn steps_per_epoch(&self) -> u64 {
        self.total_sequences / self.global_batch_size()
    }

    /// Training sequences `N`.
    pub fn total_sequences(&self) -> u64 {
        self.total_sequences
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// World size.
    pub fn world_size(&self) -> u32 {
        self.world_size
    }

    /// Micro-batch size `b`.
    pub fn micro_batch_size(&self) -> u32 {
        self.micro_batch_size
    }

    /// Micro-batches this rank runs per step: `ceil(rows_per_rank / b)` (`k` when
    /// `B = W * b * k`).
    pub fn grad_accum(&self) -> u32 {
        self.rows_per_rank()
            .div_ceil(u64::from(self.micro_batch_size))
            .try_into()
            .unwrap_or(u32::MAX)
    }

    /// All global sequence indices this rank reads in an epoch, ascending
    /// (`steps_per_epoch * rows_per_rank` of them): the sequences the coordinator streams to
    /// it. Across ranks these are disjoint and cover `[0, steps_per_epoch * B)` exactly.
    pub fn sequence_indices(&self) -> Vec<u64> {
        let (first, end) = self.rows();
        let global = self.global_batch_size();
        let mut out = Vec::with_capacity((self.steps_per_epoch() * (end - first)) as usize);
        for p in 0..self.steps_per_epoch() {
            out.extend(p * global + first..p * global + end);
        }
        out
    }

    /// Micro-batch `j` (0..k) of this rank at global step `step`.
    ///
    /// Errors: `MicroBatchOutOfRange` if `j >= k`.
    pub fn micro_batch(&self, step: u64, j: u32) -> Result<MicroBatchPlan, SplitError> {
        let k = self.grad_accum();
        if j >= k {
            return Err(SplitError::MicroBatchOutOfRange { j, grad_accum: k });
        }
        let spe = self.steps_per_epoch();
        let global = self.global_batch_size();
        let epoch = step / spe;
        let p = step % spe;
        let b = u64::from(self.micro_batch_size);
        let (first, end) = self.rows();
        let first_row = first + u64::from(j) * b;
        let rows = first_row..(first_row + b).min(end);
        Ok(MicroBatchPlan {
            epoch,
            sequence_indices: rows.clone().map(|row| p * global + row).collect(),
            sample_ids: rows.map(|row| step * global + row).collect(),
        })
    }
}
