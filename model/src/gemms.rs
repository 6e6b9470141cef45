//! How a model's GEMMs run, as a value: the precision the job asked for and whether bf16 takes
//! the native route (oneDNN) for this element type in this process.
//!
//! Made once per model from its precision ([`Gemms::new`], by `super::Bert`) and handed to
//! every layer call that multiplies, so a GEMM's route is an argument, never state of the
//! thread it runs on: the model's helper threads need no copy of it (it travels with the call),
//! and two models in one process cannot see each other's.

use keel_proto::precision::Precision;

use super::Element;
use super::element::f32_slice;

/// The route of every GEMM of one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Gemms {
    /// fp32, or bf16 inputs with fp32 accumulation.
    precision: Precision,
    /// bf16 precision, the element type is f32 and this process runs bf16 GEMMs natively
    /// (`super::bf16::support`): only then are bf16 copies of operands made and kept.
    native: bool,
    /// Whether layers keep the bf16 copies of their GEMMs' inputs from forward to backward
    /// (true but in the test that checks the kept copies against rounding at every GEMM).
    keep: bool,
}

impl Gemms {
    /// fp32 GEMMs.
    pub(crate) const FP32: Gemms = Gemms {
        precision: Precision::Fp32,
        native: false,
        keep: true,
    };

    /// The route of GEMMs over `A` in `precision` in this process.
    pub(crate) fn new<A: Element>(precision: Precision) -> Gemms {
        let is_f32 = f32_slice::<A>(&[]).is_some();
        Gemms {
            precision,
            native: precision == Precision::Bf16 && is_f32 && super::bf16::support().native,
            keep: true,
        }
    }

    /// The same route with no bf16 copy kept between GEMMs: each rounds its own operands, the
    /// reference the kept copies must reproduce bit for bit (`super::bf16_kept_tests`).
    #[cfg(test)]
    pub(crate) fn keeping_nothing(self) -> Gemms {
        Gemms {
            keep: false,
            ..self
        }
    }

    /// The precision.
    pub(crate) fn precision(self) -> Precision {
        self.precision
    }

    /// True when GEMMs round their inputs to bf16 (natively or emulated).
    pub(crate) fn bf16(self) -> bool {
        self.precision == Precision::Bf16
    }

    /// True when bf16 GEMMs run natively (oneDNN) on f32: operands may come with bf16 copies.
    pub(crate) fn native(self) -> bool {
        self.native
    }

    /// True when layers keep bf16 copies of their inputs for the backward (native route only).
    pub(crate) fn keeps(self) -> bool {
        self.native && self.keep
    }
}
