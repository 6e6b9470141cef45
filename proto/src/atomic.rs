//! The one way Keel writes a file that must never be seen half-written: a temporary file in
//! the same folder, written, given its mode, fsynced, renamed over the target, and the folder
//! fsynced so that the rename survives a crash too.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Who may read a file written by [`write_atomic`] (Unix modes; ignored elsewhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Mode 0600 (rw-------): job records, checkpoint state (a temporary file's own mode).
    Owner,
    /// Mode 0644 (rw-r--r--): outputs meant to be shared (prepared data, tokenizer files).
    Everyone,
}

/// An atomic write failed; nothing replaced the target.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct AtomicWriteError {
    /// The file being written (or its folder, when the temporary file could not be made).
    pub path: PathBuf,
    /// The underlying error.
    pub source: std::io::Error,
}

fn err(path: &Path) -> impl FnOnce(std::io::Error) -> AtomicWriteError + '_ {
    move |source| AtomicWriteError {
        path: path.to_path_buf(),
        source,
    }
}

/// The folder a file at `path` lives in (`.` for a bare name).
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Writes `bytes` to `path` atomically, readable as `access` says: see the module
/// documentation.
///
/// Errors: [`AtomicWriteError`] naming the file (or its folder).
pub fn write_atomic(path: &Path, bytes: &[u8], access: Access) -> Result<(), AtomicWriteError> {
    let dir = parent(path);
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(err(dir))?;
    tmp.write_all(bytes).map_err(err(path))?;
    persist_atomic(tmp, path, access)
}

/// Finishes a temporary file written elsewhere (in `path`'s folder): sets its mode, fsyncs it,
/// renames it to `path` and fsyncs the folder.
///
/// Errors: [`AtomicWriteError`] naming `path`; the temporary file is removed.
pub fn persist_atomic(
    tmp: tempfile::NamedTempFile,
    path: &Path,
    access: Access,
) -> Result<(), AtomicWriteError> {
    if access == Access::Everyone {
        set_readable(tmp.as_file()).map_err(err(path))?;
    }
    tmp.as_file().sync_all().map_err(err(path))?;
    tmp.persist(path).map_err(|e| err(path)(e.error))?;
    sync_dir(parent(path))
}

/// Fsyncs the folder `dir`, so that a rename or a new file in it is durable.
///
/// Errors: [`AtomicWriteError`] naming `dir`.
pub fn sync_dir(dir: &Path) -> Result<(), AtomicWriteError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(err(dir))
}

/// Gives a finished output file mode 0644 (rw-r--r--) on Unix; a no-op elsewhere.
///
/// Errors: the OS error of `set_permissions`.
pub fn set_readable(file: &std::fs::File) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
    }
    #[cfg(not(unix))]
    let _ = file;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_whole_with_the_mode_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.json");
        write_atomic(&path, b"old", Access::Owner).unwrap();
        write_atomic(&path, b"new", Access::Everyone).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&path), 0o644);
            let private = dir.path().join("b.json");
            write_atomic(&private, b"x", Access::Owner).unwrap();
            assert_eq!(mode(&private), 0o600);
        }
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 2, "no temporary file left behind");
        let err = write_atomic(&dir.path().join("no/such/c"), b"x", Access::Owner).unwrap_err();
        assert!(err.to_string().contains("no/such"), "{err}");
    }
}
