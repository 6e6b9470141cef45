//! The data folder's disk: free space before a checkpoint upload is accepted, and the
//! half-written uploads (`checkpoints/.tmp-step-N-*`) a killed coordinator leaves behind.

use std::path::Path;

/// Prefix of a checkpoint upload's folder until it is renamed into place
/// (`checkpoints/.tmp-step-N-XXXXXX`).
pub const PARTIAL_UPLOAD_PREFIX: &str = ".tmp-step-";

pub use keel_proto::disk::{free_bytes, is_disk_full};

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
