//! OpenBLAS's kernel choice on CPUs it does not know.
//!
//! Debian 12's OpenBLAS 0.3.21 is built with DYNAMIC_ARCH: when the library loads it reads
//! CPUID and picks a kernel set, and a CPU newer than the library falls back to `Prescott`
//! (SSE3). Measured on an Intel Xeon of family 6 model 207 (Emerald Rapids, AVX-512, under
//! KVM), `keel-worker bench --config mini --precision fp32`: 1,052 tokens/s as detected
//! (`Prescott`), 3,711 with `OPENBLAS_CORETYPE=SkylakeX`, 3,510 with `Cooperlake`, 2,355 with
//! `Haswell`. The choice is made once, at load, from the environment, so the worker sets
//! `OPENBLAS_CORETYPE` and executes itself again before doing anything else (`crate::startup`).

use std::ffi::{CStr, c_char};

unsafe extern "C" {
    fn openblas_get_corename() -> *const c_char;
}

/// Set in the re-executed process: what OpenBLAS had chosen, so it happens at most once.
const MARK: &str = "KEEL_OPENBLAS_DETECTED_CORE";

/// The kernel set OpenBLAS uses in this process (e.g. `SkylakeX`, `Haswell`, `Prescott`).
pub fn core_name() -> String {
    // SAFETY: OpenBLAS returns a pointer to a static NUL-terminated string.
    let p = unsafe { openblas_get_corename() };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: as above; it lives as long as the library.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The core to ask for when OpenBLAS picked `detected` on this CPU, or `None` to keep it:
/// only OpenBLAS's pre-AVX fallbacks are replaced, by the newest set the CPU can run.
pub fn better_core(detected: &str, avx512: bool, avx2_fma: bool) -> Option<&'static str> {
    let fallback = matches!(
        detected,
        "Prescott"
            | "Core2"
            | "Penryn"
            | "Dunnington"
            | "Nehalem"
            | "Atom"
            | "Katmai"
            | "Coppermine"
            | "Northwood"
            | "Banias"
    );
    if !fallback {
        None
    } else if avx512 {
        Some("SkylakeX")
    } else if avx2_fma {
        Some("Haswell")
    } else {
        None
    }
}

/// The `OPENBLAS_CORETYPE` to run with when OpenBLAS fell back to a pre-AVX kernel on a CPU
/// with AVX2 or AVX-512, with the core it had detected; `None` when the variable is already set
/// (the user's choice wins), this process is the re-executed one, or the kernel is fine.
/// `crate::startup` re-executes the program with it.
pub fn core_override() -> Option<(&'static str, String)> {
    if std::env::var_os("OPENBLAS_CORETYPE").is_some() || std::env::var_os(MARK).is_some() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl");
        let avx2_fma = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        let detected = core_name();
        better_core(&detected, avx512, avx2_fma).map(|core| (core, detected))
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// The variable the re-executed process finds set to the core OpenBLAS had detected.
pub(crate) const DETECTED_CORE_VAR: &str = MARK;

/// What the re-execution for [`core_override`] did, for the log: `Some((detected, now))` in the
/// re-executed process.
pub fn replaced_core() -> Option<(String, String)> {
    let detected = std::env::var(MARK).ok()?;
    Some((detected, core_name()))
}

#[cfg(test)]
mod tests {
    use super::better_core;

    #[test]
    fn only_pre_avx_fallbacks_are_replaced() {
        assert_eq!(better_core("Prescott", true, true), Some("SkylakeX"));
        assert_eq!(better_core("Prescott", false, true), Some("Haswell"));
        assert_eq!(better_core("Prescott", false, false), None);
        assert_eq!(better_core("Haswell", true, true), None);
        assert_eq!(better_core("SkylakeX", true, true), None);
        assert_eq!(better_core("Zen", true, true), None);
    }

    #[test]
    fn the_core_name_is_known() {
        assert!(!super::core_name().is_empty());
    }
}
