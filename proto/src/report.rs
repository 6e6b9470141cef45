//! How Keel's binaries end on an error: one line on stderr, `Error: ` and the error's causes
//! joined by `: `, exit status 1, and no backtrace.
//!
//! Returning `anyhow::Result` from `main` prints `{:?}`: a "Caused by:" list and, when
//! `RUST_BACKTRACE` is set in the environment, a backtrace of where the error was made. A
//! missing file or a refused job is the user's input, not a crash, so the binaries print the
//! chain themselves (see [`exit_on_error`]); panics (real bugs) still print their backtraces.

use std::error::Error;

/// `error` and its causes, outermost first, joined by `: `. A cause whose text the line
/// already holds is left out: error types that write their source into their own message
/// (`"{path}: {source}"`) and also return it from `source()` would otherwise name the same
/// OS error or file twice.
pub fn chain_line(error: &(dyn Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !text.is_empty() && !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = c.source();
    }
    line
}

/// Ends the process for `main`: `Ok` exits 0; an error prints `Error: ` + [`chain_line`] on
/// stderr and exits 1.
pub fn exit_on_error<E: AsRef<dyn Error + Send + Sync + 'static>>(
    result: Result<(), E>,
) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            use std::io::Write;
            // A closed stderr leaves nowhere to report: the exit status still says it.
            let _ = writeln!(
                std::io::stderr().lock(),
                "Error: {}",
                chain_line(e.as_ref())
            );
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read {path}: {source}")]
    struct ReadError {
        path: String,
        source: std::io::Error,
    }

    #[test]
    fn a_cause_already_in_the_message_is_not_repeated() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        let e = anyhow::Error::new(ReadError {
            path: "job.toml".into(),
            source: io,
        })
        .context("submitting job.toml");
        let line = chain_line(e.as_ref());
        assert_eq!(
            line,
            "submitting job.toml: cannot read job.toml: No such file or directory"
        );
    }

    #[test]
    fn every_distinct_cause_is_kept_in_order() {
        let e = anyhow::anyhow!("the root")
            .context("middle")
            .context("outer");
        assert_eq!(chain_line(e.as_ref()), "outer: middle: the root");
    }
}
