//! What a submitted job names on this machine, checked when it is submitted: a corpus path
//! that does not exist would otherwise be found only when the job is prepared, after
//! `keel submit` has already said yes.
//!
//! Paths in a job are the coordinator's (the client made them absolute against its own
//! folder; the coordinator reads them), so the check runs here, not in `keel`. It looks only at
//! names, kinds and permissions, never at contents: a file that is there but holds no text
//! still fails at preparation, with the reason in the job's status.

use crate::data::corpus::resolve_inputs;
use crate::input_roots::InputRoots;
use keel_proto::jobspec::{JobSpec, JobSpecError, ModelSource};
use std::path::{Path, PathBuf};

/// Every submit-time check of `spec`'s paths, in order: absolute and inside the input roots
/// ([`InputRoots::check_spec`]: first, so that a path outside the roots is refused alike
/// whether or not it exists), then [`check_paths`].
///
/// Errors: [`JobSpecError::Invalid`] naming the first failing key and path.
pub fn check_job(spec: &JobSpec, origin: &str, roots: &InputRoots) -> Result<(), JobSpecError> {
    roots.check_spec(spec, origin)?;
    check_paths(spec, origin)
}

/// Checks every path of `spec`:
/// - each `data.corpus` entry (file, folder or glob) resolves to at least one corpus file, and
///   each of those opens for reading;
/// - `data.vocab` and `model.config` are readable regular files;
/// - `model.init_checkpoint` is a folder holding `config.json` and `model.safetensors`.
///
/// Errors: [`JobSpecError::Invalid`] naming the first failing key, the path as given, and
/// what is wrong with it on this machine. `origin` names the job file in the message.
pub fn check_paths(spec: &JobSpec, origin: &str) -> Result<(), JobSpecError> {
    let bad = |key: &'static str, path: &str, what: String| JobSpecError::Invalid {
        origin: origin.to_string(),
        key,
        value: format!("{path:?}"),
        expected: format!("{what} on the coordinator's machine (job paths are read there)"),
    };
    for entry in &spec.data.corpus {
        let files = resolve_inputs(&[PathBuf::from(entry)]).map_err(|e| {
            let what = match e {
                crate::data::corpus::CorpusError::NotFound { .. } => {
                    "no such file, folder, or matching glob".to_string()
                }
                other => other.to_string(),
            };
            bad("data.corpus", entry, what)
        })?;
        for file in files {
            std::fs::File::open(&file).map_err(|e| {
                bad(
                    "data.corpus",
                    entry,
                    format!("cannot read {}: {e}", file.display()),
                )
            })?;
        }
    }
    if let Some(vocab) = spec.data.vocab_file() {
        readable_file(vocab)
            .map_err(|what| bad("data.vocab", &vocab.display().to_string(), what))?;
    }
    if let ModelSource::Config(config) = &spec.model.source {
        readable_file(config)
            .map_err(|what| bad("model.config", &config.display().to_string(), what))?;
    }
    if let ModelSource::InitCheckpoint(dir) = &spec.model.source {
        let shown = dir.display().to_string();
        if !dir.is_dir() {
            return Err(bad(
                "model.init_checkpoint",
                &shown,
                "no such folder".to_string(),
            ));
        }
        for name in ["config.json", "model.safetensors"] {
            readable_file(&dir.join(name))
                .map_err(|what| bad("model.init_checkpoint", &shown, format!("{name}: {what}")))?;
        }
    }
    Ok(())
}

/// Ok when `path` is a regular file this process can open; otherwise what is wrong.
fn readable_file(path: &Path) -> Result<(), String> {
    if !path.exists() {
        return Err("no such file".to_string());
    }
    if !path.is_file() {
        return Err("not a regular file".to_string());
    }
    std::fs::File::open(path)
        .map(|_| ())
        .map_err(|e| format!("cannot read it: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_with(corpus: &str, extra_data: &str, model: &str) -> JobSpec {
        let text = format!(
            "[data]\ncorpus = [{corpus:?}]\n{extra_data}\n[model]\n{model}\n[train]\n\
             micro_batch_size = 2\nmax_steps = 3\n"
        );
        JobSpec::from_toml_str(&text, "job.toml").unwrap()
    }

    #[test]
    fn a_missing_corpus_names_the_key_and_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.txt").display().to_string();
        let spec = spec_with(&missing, "vocab_size = 100", "preset = \"tiny\"");
        let text = check_paths(&spec, "job.toml").unwrap_err().to_string();
        assert!(text.contains("data.corpus"), "{text}");
        assert!(text.contains(&missing), "{text}");
        assert!(text.contains("no such file"), "{text}");
        let glob = dir.path().join("*.txt").display().to_string();
        let spec = spec_with(&glob, "vocab_size = 100", "preset = \"tiny\"");
        let text = check_paths(&spec, "job.toml").unwrap_err().to_string();
        assert!(text.contains(&glob), "{text}");
    }

    #[test]
    fn existing_paths_pass_and_a_missing_vocab_or_checkpoint_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = dir.path().join("a.txt");
        std::fs::write(&corpus, "one sentence.\n").unwrap();
        let corpus = corpus.display().to_string();
        let ok = spec_with(&corpus, "vocab_size = 100", "preset = \"tiny\"");
        check_paths(&ok, "job.toml").unwrap();
        let folder = spec_with(
            &dir.path().display().to_string(),
            "vocab_size = 100",
            "preset = \"tiny\"",
        );
        check_paths(&folder, "job.toml").unwrap();

        let vocab = dir.path().join("vocab.txt").display().to_string();
        let spec = spec_with(&corpus, &format!("vocab = {vocab:?}"), "preset = \"tiny\"");
        let text = check_paths(&spec, "job.toml").unwrap_err().to_string();
        assert!(
            text.contains("data.vocab") && text.contains(&vocab),
            "{text}"
        );

        let ckpt = dir.path().display().to_string();
        let spec = spec_with(
            &corpus,
            "vocab_size = 100",
            &format!("init_checkpoint = {ckpt:?}"),
        );
        let text = check_paths(&spec, "job.toml").unwrap_err().to_string();
        assert!(
            text.contains("model.init_checkpoint") && text.contains("config.json"),
            "{text}"
        );
    }
}
