//! The data folder's disk: free space before a checkpoint upload is accepted, and the
//! half-written uploads (`checkpoints/.tmp-step-N-*`) a killed coordinator leaves behind.

use std::path::Path;

/// Prefix of a checkpoint upload's folder until it is renamed into place
/// (`checkpoints/.tmp-step-N-XXXXXX`).
pub const PARTIAL_UPLOAD_PREFIX: &str = ".tmp-step-";

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

/// Removes every half-written checkpoint upload (`jobs/*/checkpoints/.tmp-step-*`) under
/// `jobs_dir`: at start-up no upload is in flight, so each is left over from a coordinator
/// that stopped during one. Returns the bytes freed; failures are logged, not fatal.
pub fn remove_partial_uploads(jobs_dir: &Path) -> u64 {
    let Ok(jobs) = std::fs::read_dir(jobs_dir) else {
        return 0;
    };
    let mut freed = 0;
    for job in jobs.flatten() {
        let checkpoints = job.path().join("checkpoints");
        let Ok(entries) = std::fs::read_dir(&checkpoints) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            if !name.to_string_lossy().starts_with(PARTIAL_UPLOAD_PREFIX) {
                continue;
            }
            let path = entry.path();
            let bytes = size_of(&path);
            // Never follows a link: a link is removed, not what it points to.
            let removed = match entry.file_type() {
                Ok(t) if t.is_dir() => std::fs::remove_dir_all(&path),
                _ => std::fs::remove_file(&path),
            };
            match removed {
                Ok(()) => {
                    tracing::info!(path = %path.display(), bytes, "removed a half-written checkpoint upload");
                    freed += bytes;
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), "cannot remove a half-written checkpoint upload: {e}")
                }
            }
        }
    }
    freed
}

/// Bytes of the regular files in `path` (a file, or a folder one level deep as an upload's
/// is); links are not followed.
fn size_of(path: &Path) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if !meta.is_dir() {
        return meta.len();
    }
    std::fs::read_dir(path).map_or(0, |entries| {
        entries
            .flatten()
            .filter_map(|e| std::fs::symlink_metadata(e.path()).ok())
            .filter(|m| m.is_file())
            .map(|m| m.len())
            .sum()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_uploads_are_removed_and_stored_checkpoints_kept() {
        let root = tempfile::tempdir().unwrap();
        let checkpoints = root.path().join("job-1/checkpoints");
        let partial = checkpoints.join(".tmp-step-40-abc123");
        std::fs::create_dir_all(&partial).unwrap();
        std::fs::write(partial.join("model.safetensors"), vec![0u8; 1000]).unwrap();
        std::fs::write(checkpoints.join(".tmp-step-60-file"), vec![0u8; 24]).unwrap();
        let stored = checkpoints.join("step-20");
        std::fs::create_dir_all(&stored).unwrap();
        std::fs::write(stored.join("model.safetensors"), b"kept").unwrap();
        assert_eq!(remove_partial_uploads(root.path()), 1024);
        assert!(!partial.exists());
        assert!(!checkpoints.join(".tmp-step-60-file").exists());
        assert!(stored.join("model.safetensors").is_file());
        assert_eq!(remove_partial_uploads(&root.path().join("missing")), 0);
    }

    #[test]
    fn free_space_is_known_for_a_folder_and_an_error_for_none() {
        let root = tempfile::tempdir().unwrap();
        assert!(free_bytes(root.path()).unwrap() > 0);
        assert!(free_bytes(&root.path().join("missing")).is_err());
    }
}
