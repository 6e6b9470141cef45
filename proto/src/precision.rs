//! The arithmetic of a job's GEMMs: the job file's setting (`train.precision`), the precision
//! the coordinator decides from it once per job, and how that decision is made.
//!
//! `bf16` means: every GEMM of forward and backward takes its two inputs rounded to bfloat16
//! (round to nearest even, 8 significant bits) and accumulates and writes fp32, as a TPU's
//! matrix unit does (Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning Training").
//! Weights, gradients, optimizer moments, LayerNorm, softmax, GELU, losses and the all-reduce
//! stay fp32. `fp32` is the plain fp32 path.
//!
//! Apart from that, `train.allreduce_dtype` ([`AllReduceDtype`]) sets how the gradients travel
//! on the ring: fp32 (default) or bf16, summed in fp32 at every hop either way.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// `train.precision` in the job file (and `keel-worker bench --precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionSetting {
    /// bf16 when every worker of the job reports bf16 matrix hardware that pays
    /// ([`WorkerBf16::native`]), else fp32.
    #[default]
    Auto,
    /// bf16 GEMM inputs on every worker: native where the worker has it, emulated (inputs
    /// rounded to bf16, multiplied by the fp32 GEMM: the same products, exact in fp32) elsewhere.
    Bf16,
    /// fp32 GEMMs.
    Fp32,
}

/// The precision a job runs in, decided once per job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp32 GEMMs.
    #[default]
    Fp32,
    /// bf16 GEMM inputs, fp32 accumulation and output.
    Bf16,
}

/// A precision name that is none of the known ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown precision `{0}`: expected one of auto, bf16, fp32")]
pub struct UnknownPrecision(pub String);

impl Precision {
    /// `fp32` or `bf16`: the name on the wire (`StartJob.precision`, `JobStatus.precision`),
    /// in `trainer_state.json` and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
        }
    }

    /// The precision named on the wire; an empty string (a coordinator from before precisions
    /// existed) is fp32. Errors: [`UnknownPrecision`] for any other name.
    pub fn from_wire(s: &str) -> Result<Precision, UnknownPrecision> {
        match s {
            "" | "fp32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(UnknownPrecision(other.to_string())),
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PrecisionSetting {
    /// `auto`, `bf16` or `fp32`.
    pub fn as_str(self) -> &'static str {
        match self {
            PrecisionSetting::Auto => "auto",
            PrecisionSetting::Bf16 => "bf16",
            PrecisionSetting::Fp32 => "fp32",
        }
    }

    /// The precision a job with this setting runs in, given what each of its workers reported
    /// at registration; also the reason, for the log. `auto` takes bf16 only when there is at
    /// least one worker and every one reports native bf16.
    pub fn decide(self, workers: &[WorkerBf16]) -> (Precision, String) {
        match self {
            PrecisionSetting::Fp32 => (Precision::Fp32, "train.precision = fp32".to_string()),
            PrecisionSetting::Bf16 => (Precision::Bf16, "train.precision = bf16".to_string()),
            PrecisionSetting::Auto => match workers.iter().find(|w| !w.native) {
                None if !workers.is_empty() => (
                    Precision::Bf16,
                    "train.precision = auto and every worker has native bf16".to_string(),
                ),
                None => (
                    Precision::Fp32,
                    "train.precision = auto, no workers".to_string(),
                ),
                Some(w) => (
                    Precision::Fp32,
                    format!(
                        "train.precision = auto and worker {} has no native bf16 ({})",
                        w.worker,
                        if w.detail.is_empty() {
                            "it did not report bf16 support"
                        } else {
                            &w.detail
                        }
                    ),
                ),
            },
        }
    }
}

impl fmt::Display for PrecisionSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PrecisionSetting {
    type Err = UnknownPrecision;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(PrecisionSetting::Auto),
            "bf16" => Ok(PrecisionSetting::Bf16),
            "fp32" => Ok(PrecisionSetting::Fp32),
            other => Err(UnknownPrecision(other.to_string())),
        }
    }
}

/// `train.allreduce_dtype`: how the gradient buckets travel on the ring all-reduce.
///
/// `bf16` halves the bytes on the wire: each hop rounds the partial sum it sends to bf16
/// (nearest even) and adds what it receives into its fp32 buffer, and the finished sums are
/// rounded to bf16 once, alike on every rank, so replicas stay identical. The summed gradient
/// then carries bf16's 8 significant bits (a relative error up to 2^-8 per rounding). The loss,
/// counts, evaluation sums and state broadcasts stay fp32 whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllReduceDtype {
    /// 4 bytes per gradient element.
    #[default]
    Fp32,
    /// 2 bytes per gradient element.
    Bf16,
}

impl AllReduceDtype {
    /// `fp32` or `bf16`, as in the job file.
    pub fn as_str(self) -> &'static str {
        match self {
            AllReduceDtype::Fp32 => "fp32",
            AllReduceDtype::Bf16 => "bf16",
        }
    }

    /// The ring frame's encoding of the elements (`RingFrame.dtype`).
    pub fn wire(self) -> crate::ring_rpc::WireDtype {
        match self {
            AllReduceDtype::Fp32 => crate::ring_rpc::WireDtype::F32,
            AllReduceDtype::Bf16 => crate::ring_rpc::WireDtype::Bf16,
        }
    }
}

impl fmt::Display for AllReduceDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AllReduceDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fp32" => Ok(AllReduceDtype::Fp32),
            "bf16" => Ok(AllReduceDtype::Bf16),
            other => Err(format!(
                "unknown all-reduce dtype `{other}`: expected fp32 or bf16"
            )),
        }
    }
}

/// What one worker reported at registration about bf16 (`RegisterRequest.bf16_native`,
/// `bf16_detail`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerBf16 {
    /// The worker's id, for the reason given.
    pub worker: String,
    /// Whether its bf16 GEMMs run on matrix hardware that is faster than its fp32 GEMMs.
    pub native: bool,
    /// Why or why not, as the worker said it (empty from a worker that predates the field).
    pub detail: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: &str, native: bool) -> WorkerBf16 {
        WorkerBf16 {
            worker: id.to_string(),
            native,
            detail: String::new(),
        }
    }

    #[test]
    fn auto_needs_every_worker_native() {
        let auto = PrecisionSetting::Auto;
        assert_eq!(
            auto.decide(&[w("w-1", true), w("w-2", true)]).0,
            Precision::Bf16
        );
        let (p, why) = auto.decide(&[w("w-1", true), w("w-2", false)]);
        assert_eq!(p, Precision::Fp32);
        assert!(why.contains("w-2"), "{why}");
        assert_eq!(auto.decide(&[]).0, Precision::Fp32);
        assert_eq!(
            PrecisionSetting::Bf16.decide(&[w("w-1", false)]).0,
            Precision::Bf16
        );
        assert_eq!(
            PrecisionSetting::Fp32.decide(&[w("w-1", true)]).0,
            Precision::Fp32
        );
    }

    #[test]
    fn names_round_trip() {
        for s in ["auto", "bf16", "fp32"] {
            assert_eq!(s.parse::<PrecisionSetting>().map(|p| p.as_str()), Ok(s));
        }
        assert!("fp16".parse::<PrecisionSetting>().is_err());
        assert_eq!(Precision::from_wire(""), Ok(Precision::Fp32));
        assert_eq!(Precision::from_wire("bf16"), Ok(Precision::Bf16));
        assert!(Precision::from_wire("auto").is_err());
    }
}
