//! Settings that only take effect when the process starts, applied by executing the worker
//! again with its environment amended, once, before anything else runs:
//! - `OPENBLAS_CORETYPE` when OpenBLAS fell back to pre-AVX kernels (`crate::blas_core`);
//! - transparent huge pages for glibc's heap (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`) where
//!   the kernel gives them only on request (`/sys/kernel/mm/transparent_hugepage/enabled` is
//!   `[madvise]`, Debian's default). A training step streams through activations of tens of
//!   MiB; with 4 KiB pages each pass misses the TLB on every page, and under a hypervisor each
//!   miss walks two page tables. Measured on a 2-core Intel Xeon with AMX (family 6 model 167,
//!   2026-12-04), `keel-worker bench --precision bf16`, alternated runs: mini +0%, +6%, +9%;
//!   tiny +4%, +6%, +7%; peak RSS within 2 MiB. glibc reads the tunable only at start-up.
//!
//! A user's own `GLIBC_TUNABLES` is kept (the huge-page setting is added only when it names
//! no `glibc.malloc.hugetlb`), as is a user's `OPENBLAS_CORETYPE`.

use std::ffi::OsString;

/// Set in the re-executed process, so that it happens at most once.
const REEXECUTED: &str = "KEEL_WORKER_REEXECUTED";

/// What the re-executed process has in its environment that this one lacks.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Amendments {
    /// `(OPENBLAS_CORETYPE, the core OpenBLAS had detected)`.
    pub openblas_core: Option<(&'static str, String)>,
    /// The new `GLIBC_TUNABLES`.
    pub glibc_tunables: Option<OsString>,
}

/// The environment changes this process needs ([`Amendments`]); empty when it is the
/// re-executed one.
pub fn amendments() -> Amendments {
    if std::env::var_os(REEXECUTED).is_some() {
        return Amendments::default();
    }
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    Amendments {
        openblas_core: crate::blas_core::core_override(),
        glibc_tunables: huge_page_tunables(&thp, std::env::var_os("GLIBC_TUNABLES")),
    }
}

/// The `GLIBC_TUNABLES` that asks glibc's malloc for transparent huge pages, given the
/// kernel's THP mode (the contents of `/sys/kernel/mm/transparent_hugepage/enabled`, the
/// chosen mode in brackets) and the current value; `None` when nothing is to change: THP
/// `[always]` (glibc's memory gets them anyway) or `[never]` (off on purpose), or the user set
/// `glibc.malloc.hugetlb` already.
pub fn huge_page_tunables(thp_mode: &str, current: Option<OsString>) -> Option<OsString> {
    if !thp_mode.contains("[madvise]") {
        return None;
    }
    match current {
        Some(v) if v.to_string_lossy().contains("glibc.malloc.hugetlb") => None,
        Some(v) if !v.is_empty() => {
            let mut amended = v;
            amended.push(":glibc.malloc.hugetlb=1");
            Some(amended)
        }
        _ => Some(OsString::from("glibc.malloc.hugetlb=1")),
    }
}

/// Executes this program again with [`amendments`] applied, when there are any. Returns only
/// if nothing was to change or the exec failed (then the process goes on as it is: correct,
/// only slower).
pub fn reexec_if_needed() {
    let a = amendments();
    if a == Amendments::default() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(std::env::args_os().skip(1)).env(REEXECUTED, "1");
    if let Some((core, detected)) = &a.openblas_core {
        cmd.env("OPENBLAS_CORETYPE", core)
            .env(crate::blas_core::DETECTED_CORE_VAR, detected);
    }
    if let Some(tunables) = &a.glibc_tunables {
        cmd.env("GLIBC_TUNABLES", tunables);
    }
    let err = cmd.exec();
    eprintln!("keel-worker: could not re-execute with {a:?}: {err}");
}

#[cfg(test)]
mod tests {
    use super::huge_page_tunables;
    use std::ffi::OsString;

    #[test]
    fn huge_pages_are_asked_for_only_in_madvise_mode_and_never_over_the_users_choice() {
        let madvise = "always [madvise] never\n";
        assert_eq!(
            huge_page_tunables(madvise, None),
            Some(OsString::from("glibc.malloc.hugetlb=1"))
        );
        assert_eq!(
            huge_page_tunables(madvise, Some(OsString::new())),
            Some(OsString::from("glibc.malloc.hugetlb=1"))
        );
        assert_eq!(
            huge_page_tunables(madvise, Some("glibc.malloc.arena_max=2".into())),
            Some(OsString::from(
                "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
            ))
        );
        assert_eq!(
            huge_page_tunables(madvise, Some("glibc.malloc.hugetlb=0".into())),
            None
        );
        assert_eq!(huge_page_tunables("[always] madvise never\n", None), None);
        assert_eq!(huge_page_tunables("always madvise [never]\n", None), None);
        assert_eq!(huge_page_tunables("", None), None);
    }
}
