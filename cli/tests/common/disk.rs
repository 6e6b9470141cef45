//! A small file system the test mounts for a folder (root only), and a file that fills it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs mounted on a folder while this lives; unmounted when dropped (declare it before
/// the processes that use it, so that they are killed first).
pub struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (`40m`) on `dir`; `None`, after saying why, when this process
    /// may not (not root).
    pub fn mount(dir: &Path, size: &str) -> Option<Tmpfs> {
        let uid = Command::new("id").arg("-u").output().ok()?;
        if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
            println!("SKIPPED: needs root to mount a tmpfs");
            return None;
        }
        std::fs::create_dir_all(dir).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .unwrap();
        if !mounted.success() {
            println!("SKIPPED: needs root to mount a tmpfs (mount failed: {mounted})");
            return None;
        }
        Some(Tmpfs {
            dir: dir.to_path_buf(),
        })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let unmounted = Command::new("umount").arg(&self.dir).status();
        if !unmounted.is_ok_and(|s| s.success()) {
            // Still busy (a process not reaped yet): detach it now, freed when idle.
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

/// Fills the file system of `dir` with `dir/filler` until it is full (at most 4 GiB), then
/// gives back `leave` bytes; returns the filler's path.
pub fn fill(dir: &Path, leave: u64) -> PathBuf {
    let path = dir.join("filler");
    let mut file = std::fs::File::create(&path).unwrap();
    let block = vec![0x5au8; 1 << 20];
    for _ in 0..4096 {
        if file.write_all(&block).is_err() {
            break;
        }
    }
    let _ = file.sync_all();
    let len = file.metadata().unwrap().len();
    file.set_len(len.saturating_sub(leave)).unwrap();
    path
}
