//! The disk under a folder: how much room is left, and whether an error says it is full.
//! Shared by the coordinator (its data folder: checkpoint uploads, preparation) and the
//! workers (their cache: the files of a job).

use std::path::Path;

/// Bytes an unprivileged process may still write in the file system holding `dir`
/// (statvfs: available blocks times the fragment size).
///
/// Errors: the `statvfs` call's (no such folder, a path with a NUL byte).
pub fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `statvfs` is plain old data; all-zero bytes are a valid value of it.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a NUL-terminated string that outlives the call, and `stat` is a valid,
    // exclusively borrowed `statvfs` for the call to fill in.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut stat) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // The field types differ between platforms.
    Ok((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

/// Whether `e` says the file system is full (ENOSPC) or the user's quota is (EDQUOT).
pub fn is_disk_full(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
        || e.kind() == std::io::ErrorKind::StorageFull
}
