//! Whether this machine runs bf16 GEMMs faster than fp32: AMX-BF16 usable through oneDNN.
//!
//! Three things must hold (checked in this order, the first failure named in the detail):
//! 1. CPUID leaf 7, sub-leaf 0, EDX bit 22 (AMX-BF16) and bit 24 (AMX-TILE) are set (Intel SDM
//!    vol. 2A, CPUID; there is no stable `is_x86_feature_detected!` name for AMX).
//! 2. Linux lets this process use the tile data: `arch_prctl(ARCH_REQ_XCOMP_PERM,
//!    XFEATURE_XTILEDATA)` succeeds (Linux >= 5.16, Documentation/arch/x86/xstate.rst).
//! 3. oneDNN creates and runs a bf16 matmul and its implementation is an AMX one.
//!
//! AVX512_BF16 without AMX is reported but not native: oneDNN 2.6.3's bf16 matmul there ran at
//! 36-41 GFLOP/s against 55-103 for f32 on the same core (see `super::bf16`).

use super::bf16::Bf16Support;

/// `arch_prctl` code asking for permission to use an XSAVE feature (asm/prctl.h).
#[cfg(target_arch = "x86_64")]
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
/// The AMX tile-data XSAVE feature number.
#[cfg(target_arch = "x86_64")]
const XFEATURE_XTILEDATA: libc::c_long = 18;

/// Probes the machine (see the module doc).
pub(crate) fn detect() -> Bf16Support {
    let not = |detail: String| Bf16Support {
        native: false,
        detail,
    };
    if std::env::var("KEEL_BF16_BACKEND").is_ok_and(|v| v == "emulated") {
        return not("KEEL_BF16_BACKEND=emulated set: bf16 GEMMs emulated".into());
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid_count;
        let avx512_bf16 = std::arch::is_x86_feature_detected!("avx512bf16");
        // CPUID exists on every x86-64 CPU; leaf 0 gives the highest leaf.
        let max_leaf = __cpuid_count(0, 0).eax;
        let edx = if max_leaf >= 7 {
            __cpuid_count(7, 0).edx
        } else {
            0
        };
        let (amx_bf16, amx_tile) = (edx & (1 << 22) != 0, edx & (1 << 24) != 0);
        if !(amx_bf16 && amx_tile) {
            return not(format!(
                "no AMX-BF16/AMX-TILE (CPUID.7.0:EDX bits 22/24 = {}/{}){}",
                u8::from(amx_bf16),
                u8::from(amx_tile),
                if avx512_bf16 {
                    "; AVX512_BF16 is present, but oneDNN's bf16 matmul without AMX is slower than fp32"
                } else {
                    "; no AVX512_BF16 either"
                }
            ));
        }
        // SAFETY: arch_prctl with a permission request only changes this process's XSAVE
        // permissions; it reads no memory of ours.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        if rc != 0 {
            return not(format!(
                "AMX-BF16 present but the kernel refused the tile data \
                 (arch_prctl(ARCH_REQ_XCOMP_PERM): {})",
                std::io::Error::last_os_error()
            ));
        }
        match probe_onednn() {
            Ok(name) if name.contains("amx") => Bf16Support {
                native: true,
                detail: format!("AMX-BF16 through oneDNN ({name})"),
            },
            Ok(name) => not(format!(
                "AMX-BF16 present but oneDNN chose `{name}` for bf16, not an AMX kernel"
            )),
            Err(e) => not(format!("AMX-BF16 present but {e}")),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    not("not an x86-64 CPU: no AMX".into())
}

/// Creates and runs one small bf16 matmul; returns oneDNN's implementation name.
#[cfg(target_arch = "x86_64")]
fn probe_onednn() -> Result<String, super::onednn::DnnlError> {
    use ndarray::Array2;
    let a = Array2::<u16>::from_elem((32, 32), super::bf16::bf16_bits(1.0));
    let mut c = Array2::<f32>::zeros((32, 32));
    let name = super::onednn::matmul(
        super::onednn::InputType::Bf16,
        1.0,
        &a.view(),
        &a.t(),
        0.0,
        &mut c.view_mut(),
    )?;
    if c.iter().any(|&x| x != 32.0) {
        return Err(super::onednn::DnnlError::Status {
            what: "checking a probe matmul (wrong result)".into(),
            status: 5,
        });
    }
    Ok(name)
}
