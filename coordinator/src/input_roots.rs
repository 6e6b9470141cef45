//! Which files a job may name: `keel-coordinator --input-root DIR` (repeatable,
//! `KEEL_INPUT_ROOT`). With at least one root, every path of a job — each `data.corpus` entry
//! and every file it expands to, `data.vocab` (a `vocab.txt` or `tokenizer.json`),
//! `model.config`, `model.init_checkpoint` and the two files read from it — must lie inside a
//! root once symlinks are resolved; with none, any file the coordinator can read may be named
//! (it warns at startup). A relative path is refused either way: it would resolve against the
//! coordinator's working directory, and `keel submit` always sends absolute ones.
//!
//! The check runs at submit ([`crate::submit_check::check_job`]), before the existence check
//! (so a path outside the roots is refused the same way whether or not it exists), again before
//! every preparation ([`crate::prepare_job::prepare_within`]) and for jobs restored after a
//! restart: a symlink placed or changed after the submit is caught there.

use crate::data::corpus::{CorpusError, resolve_inputs};
use keel_proto::jobspec::{JobSpec, JobSpecError, ModelSource};
use std::path::{Component, Path, PathBuf};

/// A `--input-root` that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum InputRootError {
    /// The folder cannot be resolved (missing, unreadable).
    #[error("--input-root {path}: {source}")]
    Unusable {
        /// The root as given.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The path is not a folder.
    #[error("--input-root {path}: not a folder")]
    NotAFolder {
        /// The root as given.
        path: PathBuf,
    },
}

/// The folders a job's paths must lie in (canonical: symlinks resolved); empty = anywhere.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InputRoots {
    /// Canonical folders.
    roots: Vec<PathBuf>,
}

impl InputRoots {
    /// The roots `given` (flags or `KEEL_INPUT_ROOT`), each resolved now; empty strings (from
    /// `KEEL_INPUT_ROOT=` or a trailing separator) are skipped.
    ///
    /// Errors: [`InputRootError`] for a root that does not exist or is not a folder.
    pub fn new(given: &[PathBuf]) -> Result<InputRoots, InputRootError> {
        let mut roots = Vec::new();
        for path in given.iter().filter(|p| !p.as_os_str().is_empty()) {
            let canonical = path
                .canonicalize()
                .map_err(|source| InputRootError::Unusable {
                    path: path.clone(),
                    source,
                })?;
            if !canonical.is_dir() {
                return Err(InputRootError::NotAFolder { path: path.clone() });
            }
            if !roots.contains(&canonical) {
                roots.push(canonical);
            }
        }
        Ok(InputRoots { roots })
    }

    /// No root: any readable file may be named.
    pub fn is_empty(&self) -> bool {
        self.roots.is_empty()
    }

    /// The canonical roots.
    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    /// `/srv/keel/data, /mnt/corpora`: how errors and logs name the roots.
    pub fn describe(&self) -> String {
        self.roots
            .iter()
            .map(|r| format!("{:?}", r.display().to_string()))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Checks every path of `spec`: absolute always; inside a root when there is one.
    ///
    /// Errors: [`JobSpecError::Invalid`] naming the key, the path as given (and the file it
    /// resolved to when that differs) and the roots. `origin` names the job in the message.
    pub fn check_spec(&self, spec: &JobSpec, origin: &str) -> Result<(), JobSpecError> {
        let bad = |key: &'static str, path: &Path, what: String| JobSpecError::Invalid {
            origin: origin.to_string(),
            key,
            value: format!("{:?}", path.display().to_string()),
            expected: what,
        };
        spec.check_paths_absolute().map_err(|e| e.at(origin))?;
        let mut named: Vec<(&'static str, PathBuf)> = spec
            .data
            .corpus
            .iter()
            .map(|entry| ("data.corpus", PathBuf::from(entry)))
            .collect();
        named.extend(
            spec.named_paths()
                .into_iter()
                .map(|(key, p)| (key, p.to_path_buf())),
        );
        if self.is_empty() {
            return Ok(());
        }
        for (key, path) in &named {
            // A glob's literal folder must lie inside a root before it is expanded: otherwise
            // whether `/etc/sha*` matches would tell a client which files exist outside.
            let literal = literal_prefix(path);
            self.check_one(&literal)
                .map_err(|resolved| bad(key, path, self.outside(&literal, &resolved)))?;
        }
        for entry in &spec.data.corpus {
            let path = PathBuf::from(entry);
            // Missing inputs are the existence check's to report (crate::submit_check).
            let files = match resolve_inputs(std::slice::from_ref(&path)) {
                Ok(files) => files,
                Err(CorpusError::NotFound { .. } | CorpusError::NoFiles { .. }) => continue,
                Err(e) => return Err(bad("data.corpus", &path, e.to_string())),
            };
            for file in files {
                self.check_one(&file).map_err(|resolved| {
                    bad("data.corpus", &path, self.outside(&file, &resolved))
                })?;
            }
        }
        if let ModelSource::InitCheckpoint(dir) = &spec.model.source {
            for name in ["config.json", keel_proto::checkpoint::MODEL_FILE] {
                let file = dir.join(name);
                self.check_one(&file).map_err(|resolved| {
                    bad("model.init_checkpoint", dir, self.outside(&file, &resolved))
                })?;
            }
        }
        Ok(())
    }

    /// Ok when `path`, resolved ([`resolve`]), lies inside a root (always Ok without roots);
    /// otherwise the resolved path.
    pub fn check_one(&self, path: &Path) -> Result<(), PathBuf> {
        if self.is_empty() {
            return Ok(());
        }
        let resolved = resolve(path);
        if self.roots.iter().any(|root| resolved.starts_with(root)) {
            Ok(())
        } else {
            Err(resolved)
        }
    }

    /// What an error says of `path` (resolved to `resolved`) outside the roots.
    fn outside(&self, path: &Path, resolved: &Path) -> String {
        let shown = if path == resolved {
            format!("{:?}", path.display().to_string())
        } else {
            format!(
                "{:?} (resolved: {:?})",
                path.display().to_string(),
                resolved.display().to_string()
            )
        };
        format!(
            "{shown} lies outside the coordinator's input roots ({}): a job may name only files \
             inside them (keel-coordinator --input-root)",
            self.describe()
        )
    }
}

/// `path` with `.` and `..` applied and every symlink of its longest existing ancestor
/// resolved; the part that does not exist is appended as written (normalised).
pub fn resolve(path: &Path) -> PathBuf {
    let mut normal = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                normal.pop();
            }
            other => normal.push(other.as_os_str()),
        }
    }
    if let Ok(canonical) = normal.canonicalize() {
        return canonical;
    }
    // The longest ancestor that exists, canonicalised, then the rest.
    let mut rest = Vec::new();
    let mut base = normal.clone();
    while let Some(name) = base.file_name().map(|n| n.to_os_string()) {
        rest.push(name);
        base.pop();
        if let Ok(canonical) = base.canonicalize() {
            let mut out = canonical;
            out.extend(rest.iter().rev());
            return out;
        }
    }
    normal
}

/// The components of `path` before the first one holding a glob character (`*?[`): the folder
/// a glob expands in; `path` itself when it holds none.
fn literal_prefix(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        if component
            .as_os_str()
            .to_string_lossy()
            .contains(['*', '?', '['])
        {
            break;
        }
        out.push(component.as_os_str());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_applies_dot_dot_and_symlinks_of_existing_ancestors() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        std::fs::create_dir(base.join("a")).unwrap();
        std::os::unix::fs::symlink("/etc", base.join("a/link")).unwrap();
        assert_eq!(resolve(&base.join("a/../a/x.txt")), base.join("a/x.txt"));
        assert_eq!(
            resolve(&base.join("a/link/nope")),
            PathBuf::from("/etc/nope")
        );
        assert_eq!(
            literal_prefix(Path::new("/data/*/x.txt")),
            PathBuf::from("/data")
        );
    }
}
