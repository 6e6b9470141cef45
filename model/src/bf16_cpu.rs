//! Whether this machine runs bf16 GEMMs faster than fp32, decided from what it really does.
//!
//! Two ways to native bf16, tried in this order (the first failure is named in the detail):
//! - **AMX-BF16**: CPUID leaf 7, sub-leaf 0, EDX bit 22 (AMX-BF16) and bit 24 (AMX-TILE) are set
//!   (Intel SDM vol. 2A, CPUID; there is no stable `is_x86_feature_detected!` name for AMX);
//!   Linux lets this process use the tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//!   XFEATURE_XTILEDATA)`, Linux >= 5.16, Documentation/arch/x86/xstate.rst); and oneDNN creates
//!   and runs a bf16 matmul with an AMX implementation. AMX does 5-10x the fp32 rate, so no race.
//! - **AVX512_BF16 without AMX** (`VDPBF16PS`: Cooper Lake, AMD Zen 4 and Zen 5): whether it pays
//!   depends on the core. On a Sapphire Rapids Xeon capped to AVX512_CORE_BF16 oneDNN 2.6.3's
//!   bf16 matmul ran at 36-41 GFLOP/s against 55-103 for f32; on a 2-core AMD EPYC of family 26
//!   (Zen 5, 2026-12-01) it made a whole BERT-mini step 1.5x faster than OpenBLAS fp32. So the
//!   probe races them: the same BERT-shaped GEMMs (a projection and a weight gradient, bf16 with
//!   its input conversions, against OpenBLAS fp32 on one thread), best of [`RACE_ROUNDS`]
//!   interleaved rounds, and takes the native route only when bf16 is at least
//!   [`RACE_MARGIN`] times faster. The margin keeps the choice stable on one kind of machine
//!   (the two measured cases are far from it on either side), which the job's determinism
//!   needs: the route changes the order of the sums. Each round is timed in this thread's
//!   CPU time, not wall time: on a busy machine (a test suite compiling beside a job) the
//!   rounds of either route lose the core to other processes at random, and wall-clock rounds
//!   measured 75 against 56 GFLOP/s there (1.34x) where an idle machine gives 190 against 100,
//!   close enough to the margin for two runs of one job to choose differently.

/// `arch_prctl` code asking for permission to use an XSAVE feature (asm/prctl.h).
#[cfg(target_arch = "x86_64")]
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
/// The AMX tile-data XSAVE feature number.
#[cfg(target_arch = "x86_64")]
const XFEATURE_XTILEDATA: libc::c_long = 18;

/// Whether this process runs bf16 GEMMs on hardware, and why (decided once per process).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bf16Support {
    /// oneDNN's bf16 matmul is usable and faster than fp32: bf16 GEMMs take the native route.
    pub native: bool,
    /// What was found, for registration, logs and the bench (CPU features, kernel permission,
    /// the oneDNN implementation, or what failed).
    pub detail: String,
}

/// Probes the machine (see the module doc).
pub(crate) fn detect() -> Bf16Support {
    let not = |detail: String| Bf16Support {
        native: false,
        detail,
    };
    let forced = std::env::var("KEEL_BF16_BACKEND").ok();
    if forced.as_deref() == Some("emulated") {
        return not("KEEL_BF16_BACKEND=emulated set: bf16 GEMMs emulated".into());
    }
    #[cfg(target_arch = "x86_64")]
    if forced.as_deref() == Some("native") {
        // For measuring oneDNN's bf16 kernel on a CPU without AMX (AVX512_BF16 alone).
        return match probe_onednn() {
            Ok(name) => Bf16Support {
                native: true,
                detail: format!("KEEL_BF16_BACKEND=native set: oneDNN ({name})"),
            },
            Err(e) => not(format!("KEEL_BF16_BACKEND=native set, but {e}: emulated")),
        };
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
            let no_amx = format!(
                "no AMX-BF16/AMX-TILE (CPUID.7.0:EDX bits 22/24 = {}/{})",
                u8::from(amx_bf16),
                u8::from(amx_tile),
            );
            if !avx512_bf16 {
                return not(format!("{no_amx}; no AVX512_BF16 either"));
            }
            return match probe_onednn().and_then(|name| race().map(|r| (name, r))) {
                Err(e) => not(format!("{no_amx}; AVX512_BF16 present but {e}")),
                Ok((name, race)) => Bf16Support {
                    native: race.pays(),
                    detail: format!(
                        "{no_amx}; AVX512_BF16 through oneDNN ({name}): {}",
                        race.describe()
                    ),
                },
            };
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

/// Creates and runs one small bf16 matmul, and one with a bias (the form a Linear's forward
/// uses: `super::gemm::gemm_bias`), checking both results; returns oneDNN's implementation
/// name. A CPU where either fails trains with emulated bf16 instead of failing a step later.
#[cfg(target_arch = "x86_64")]
fn probe_onednn() -> Result<String, super::onednn::DnnlError> {
    use ndarray::Array2;
    let a = Array2::<u16>::from_elem((32, 32), super::bf16_convert::bf16_bits(1.0));
    let bias = [1.0f32; 32];
    let mut name = String::new();
    for (with_bias, want) in [(false, 32.0), (true, 33.0)] {
        let mut c = Array2::<f32>::zeros((32, 32));
        name = super::onednn::matmul(
            super::onednn::InputType::Bf16,
            (1.0, &a.view(), &a.t()),
            with_bias.then_some(&bias[..]),
            0.0,
            &mut c.view_mut(),
        )?;
        if c.iter().any(|&x| x != want) {
            return Err(super::onednn::DnnlError::Status {
                what: format!("checking a probe matmul (wrong result; bias: {with_bias})"),
                status: 5,
            });
        }
    }
    Ok(name)
}

#[cfg(target_arch = "x86_64")]
/// Rounds of the race (each runs every shape once per route); the best of them counts.
const RACE_ROUNDS: usize = 4;
#[cfg(target_arch = "x86_64")]
/// How many times faster than fp32 bf16 must be to be chosen.
const RACE_MARGIN: f64 = 1.2;

#[cfg(target_arch = "x86_64")]
/// What [`race`] measured: CPU seconds of the best round of each route.
#[derive(Debug, Clone, Copy)]
struct Race {
    /// oneDNN bf16 (inputs converted from f32 on every call, as the model does).
    bf16_s: f64,
    /// OpenBLAS fp32 on one thread.
    fp32_s: f64,
    /// Floating-point operations of one round.
    flops: f64,
    /// OpenBLAS's thread count while fp32 was timed (1: the clock counts this thread only).
    fp32_threads: usize,
}

#[cfg(target_arch = "x86_64")]
impl Race {
    fn pays(&self) -> bool {
        self.bf16_s * RACE_MARGIN <= self.fp32_s
    }

    fn describe(&self) -> String {
        format!(
            "{:.0} GFLOP/s against {:.0} for OpenBLAS fp32 on {} thread{} ({:.2}x; bf16 taken from {RACE_MARGIN}x): {}",
            self.flops / self.bf16_s / 1e9,
            self.flops / self.fp32_s / 1e9,
            self.fp32_threads,
            if self.fp32_threads == 1 { "" } else { "s" },
            self.fp32_s / self.bf16_s,
            if self.pays() {
                "bf16 is native"
            } else {
                "fp32 is faster, bf16 would be emulated"
            }
        )
    }
}

/// CPU time of the calling thread (seconds): both routes run on it alone (oneDNN with a team of
/// one, OpenBLAS set to one thread), and time the thread spends waiting for a core is left
/// out. Falls back to wall time where the clock is missing.
#[cfg(target_arch = "x86_64")]
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec; the clock id is a constant Linux supports.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0 {
        return ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9;
    }
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs_f64()
}

/// Times BERT-shaped GEMMs (hidden 256, feed-forward 1024, 1024 tokens: a BERT-mini FFN
/// projection `[1024, 256] x [256, 1024]` and its weight gradient `[1024, 1024]^T x [1024, 256]`)
/// in bf16 through oneDNN and in fp32 through OpenBLAS, one thread each; see the module doc.
#[cfg(target_arch = "x86_64")]
fn race() -> Result<Race, super::onednn::DnnlError> {
    use super::bf16_convert::bf16_bits;
    use super::onednn::{InputType, matmul};
    use ndarray::{Array2, linalg::general_mat_mul};

    // OpenBLAS on one thread for the race, whatever the process has set, and the count put
    // back after it. The worker and the bench set one thread before they probe, but a process
    // that never set it (`keel-worker bf16-probe`, a test) has OpenBLAS's default of one per
    // core: its fp32 GEMMs then ran on every core while the clock counted this thread alone,
    // and on a 2-core Xeon with AVX512_BF16 fp32 read 380 GFLOP/s against 223 on one thread,
    // turning oneDNN's 1.7x into 0.95x and the probe's answer from native to emulated.
    let _one_thread = OneBlasThread::take();
    let fill = |r: usize, c: usize, seed: usize| {
        Array2::from_shape_fn((r, c), |(i, j)| {
            ((i * 31 + j * 17 + seed) % 97) as f32 / 97.0 - 0.5
        })
    };
    let (tokens, hidden, ffn) = (1024, 256, 1024);
    let x = fill(tokens, hidden, 1);
    let w = fill(ffn, hidden, 2);
    let dy = fill(tokens, ffn, 3);
    // (a, b, c): c = a b; the second is a transposed-operand form, as backward runs it.
    let shapes = [(x.view(), w.t()), (dy.t(), x.view())];
    let flops: f64 = shapes
        .iter()
        .map(|(a, b)| 2.0 * (a.nrows() * a.ncols() * b.ncols()) as f64)
        .sum();
    let mut outs: Vec<Array2<f32>> = shapes
        .iter()
        .map(|(a, b)| Array2::zeros((a.nrows(), b.ncols())))
        .collect();
    let (mut best_bf16, mut best_fp32) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..RACE_ROUNDS {
        let start = thread_cpu_seconds();
        for ((a, b), c) in shapes.iter().zip(&mut outs) {
            general_mat_mul(1.0, a, b, 0.0, c);
        }
        best_fp32 = best_fp32.min(thread_cpu_seconds() - start);
        let start = thread_cpu_seconds();
        for ((a, b), c) in shapes.iter().zip(&mut outs) {
            // Converted in the operand's own memory order, as `super::bf16` does.
            let a16 = if a.is_standard_layout() {
                a.mapv(bf16_bits)
            } else {
                a.t().mapv(bf16_bits).reversed_axes()
            };
            let b16 = if b.is_standard_layout() {
                b.mapv(bf16_bits)
            } else {
                b.t().mapv(bf16_bits).reversed_axes()
            };
            matmul(
                InputType::Bf16,
                (1.0, &a16.view(), &b16.view()),
                None,
                0.0,
                &mut c.view_mut(),
            )?;
        }
        best_bf16 = best_bf16.min(thread_cpu_seconds() - start);
    }
    Ok(Race {
        bf16_s: best_bf16,
        fp32_s: best_fp32,
        flops,
        fp32_threads: crate::parallel::openblas_threads(),
    })
}

/// OpenBLAS set to one thread while it lives; the count it had comes back when it drops.
#[cfg(target_arch = "x86_64")]
struct OneBlasThread(usize);

#[cfg(target_arch = "x86_64")]
impl OneBlasThread {
    fn take() -> Self {
        let before = crate::parallel::openblas_threads();
        crate::parallel::set_openblas_threads(1);
        OneBlasThread(before)
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for OneBlasThread {
    fn drop(&mut self) {
        crate::parallel::set_openblas_threads(self.0);
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn bf16_is_native_only_from_the_margin_on() {
        let race = |bf16_s| Race {
            bf16_s,
            fp32_s: 1.2,
            flops: 1e9,
            fp32_threads: 1,
        };
        assert!(race(1.0).pays(), "exactly 1.2x faster");
        assert!(!race(1.01).pays(), "1.19x faster");
        assert!(!race(2.0).pays(), "slower");
        assert!(race(0.2).describe().contains("6.00x"));
    }

    /// The race's clock counts this thread's work, not time spent waiting for a core: a sleep
    /// adds (almost) nothing to it, a busy loop adds.
    #[test]
    fn the_race_clock_leaves_out_waiting() {
        let start = thread_cpu_seconds();
        std::thread::sleep(std::time::Duration::from_millis(60));
        let asleep = thread_cpu_seconds() - start;
        assert!(asleep < 0.02, "60 ms asleep counted as {asleep} s of CPU");
        let start = thread_cpu_seconds();
        let wall = std::time::Instant::now();
        let mut x = 0u64;
        while wall.elapsed().as_millis() < 30 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        assert!(
            thread_cpu_seconds() - start > 0.0,
            "30 ms of spinning counted as no CPU"
        );
    }

    /// The race times OpenBLAS on one thread even in a process whose OpenBLAS runs on more
    /// (the failing case: `keel-worker bf16-probe`, which never sets a thread count), and puts
    /// the process's count back afterwards.
    #[test]
    fn the_race_runs_openblas_on_one_thread_and_restores_the_count() {
        use crate::parallel::{openblas_threads, set_openblas_threads};
        set_openblas_threads(2);
        let race = race();
        let after = openblas_threads();
        set_openblas_threads(1);
        let race = match race {
            Ok(race) => race,
            Err(e) => {
                println!("SKIPPED: oneDNN runs no bf16 matmul on this CPU ({e})");
                return;
            }
        };
        assert_eq!(race.fp32_threads, 1, "{race:?}");
        assert_eq!(
            after, 2,
            "the race left OpenBLAS at {after} threads, not the 2 it had"
        );
    }

    /// On a CPU with AVX512_BF16 and no AMX the probe races the routes and says what it
    /// measured; where oneDNN wins, its bf16 kernel is the one the detail names.
    #[test]
    fn avx512_bf16_without_amx_is_decided_by_the_race() {
        let support = detect();
        println!("{}", support.detail);
        if !std::arch::is_x86_feature_detected!("avx512bf16") {
            assert!(
                !support.native || support.detail.contains("AMX"),
                "{support:?}"
            );
            println!("SKIPPED the race: this CPU has no AVX512_BF16");
            return;
        }
        if support.detail.contains("no AMX") {
            assert!(support.detail.contains("GFLOP/s against"), "{support:?}");
            assert_eq!(
                support.native,
                support.detail.ends_with("bf16 is native"),
                "{support:?}"
            );
        }
    }
}
