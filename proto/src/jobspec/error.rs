//! What goes wrong with a job file: [`JobSpecError`] for the file as a whole (its origin in
//! every message), [`SpecError`] for one value, as a section's own check finds it.

use std::path::PathBuf;

/// A job file that could not be read or is not valid.
#[derive(Debug, thiserror::Error)]
pub enum JobSpecError {
    /// The file could not be read.
    #[error("cannot read job file {path}: {source}")]
    Io {
        /// The job file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The text is not TOML of the expected shape (unknown key, wrong type, missing key).
    /// The message carries toml's line/column and the key.
    #[error("{origin}: {message}")]
    Parse {
        /// File name (or other origin) of the text.
        origin: String,
        /// What toml/serde said, with the key and position.
        message: String,
    },
    /// A key has a value outside what is allowed.
    #[error("{origin}: `{key}` = {value}: {expected}")]
    Invalid {
        /// File name (or other origin) of the text.
        origin: String,
        /// Dotted key, e.g. `train.learning_rate`.
        key: &'static str,
        /// The value given, as written back.
        value: String,
        /// What is allowed.
        expected: String,
    },
}

/// One value of a job file that is not allowed, as a section's check finds it: the section
/// does not know the file's name, [`SpecError::at`] adds it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{key}` = {value}: {expected}")]
pub struct SpecError {
    /// Dotted key, e.g. `train.learning_rate`.
    pub key: &'static str,
    /// The value given, as written back (`phase 2: ...` for a `[[phase]]` setting).
    pub value: String,
    /// What is allowed.
    pub expected: String,
}

impl SpecError {
    /// The error for `key`, given `value`, allowing `expected`.
    pub fn new(key: &'static str, value: impl Into<String>, expected: impl Into<String>) -> Self {
        SpecError {
            key,
            value: value.into(),
            expected: expected.into(),
        }
    }

    /// The same error in the job file `origin` (usually its path).
    pub fn at(self, origin: &str) -> JobSpecError {
        JobSpecError::Invalid {
            origin: origin.to_string(),
            key: self.key,
            value: self.value,
            expected: self.expected,
        }
    }
}
