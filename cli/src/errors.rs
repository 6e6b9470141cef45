//! One place that turns a failed call to the coordinator into a sentence for the user.
//!
//! Every client command keeps the `tonic::Status` of a failed call inside its error (with
//! `?` or `.with_context(..)`: never flattened to text), so that this module can read its code:
//! - UNAVAILABLE: the coordinator is not there (naming the address, how to set it);
//! - UNAUTHENTICATED: the token was refused;
//! - UNIMPLEMENTED: something answers at the address, but not a Keel coordinator (a worker's
//!   port, another gRPC server);
//! - a broken-off connection: perhaps a TLS server called in plaintext;
//! - anything else (NOT_FOUND, INVALID_ARGUMENT, ...): the coordinator's own message after the
//!   command's context, without tonic's `code: '...', message: "..."` wrapping.

/// Rewrites `e`, an error of a command that talked to the coordinator at `addr`, as described
/// in the module docs. A closed stdout and errors without a gRPC status pass through unchanged.
pub fn explain(e: anyhow::Error, addr: &str) -> anyhow::Error {
    if crate::output::is_closed_pipe(&e) {
        return e;
    }
    let Some(status) = e
        .chain()
        .find_map(|cause| cause.downcast_ref::<tonic::Status>())
    else {
        return e;
    };
    match status.code() {
        tonic::Code::Unauthenticated => {
            return anyhow::anyhow!(
                "the coordinator at {addr} refused the cluster token: {}; give the cluster's \
                 token file with --token-file or KEEL_TOKEN_FILE",
                status.message()
            );
        }
        tonic::Code::Unimplemented => {
            return anyhow::anyhow!(
                "{addr} answers, but it is not a Keel coordinator (it does not serve the \
                 coordinator's calls): is it a worker's port? Give the coordinator's address \
                 (keel-coordinator --listen, port 7070 unless set) with --coordinator or \
                 KEEL_COORDINATOR"
            );
        }
        _ => {}
    }
    if tls_mismatch(&e) {
        return anyhow::anyhow!(
            "the coordinator at {addr} broke off the connection ({}): if it serves TLS, pass \
             --tls-ca (or KEEL_TLS_CA) with the CA that signed its certificate",
            e.root_cause()
        );
    }
    if status.code() == tonic::Code::Unavailable {
        return anyhow::anyhow!(
            "cannot reach the coordinator at {addr} ({}): is keel-coordinator running there? \
             (set it with --coordinator or KEEL_COORDINATOR)",
            e.root_cause()
        );
    }
    // The command's own context (what it was doing), then what the coordinator said.
    let mut parts: Vec<String> = e
        .chain()
        .take_while(|cause| !cause.is::<tonic::Status>())
        .map(|cause| cause.to_string())
        .collect();
    parts.push(if status.message().is_empty() {
        format!("the coordinator at {addr} answered: {}", status.code())
    } else {
        status.message().to_string()
    });
    anyhow::anyhow!(parts.join(": "))
}

/// Whether the chain says the server broke off the connection. A plaintext call to a TLS
/// server ends in an HTTP/2 framing error, or (depending on timing) in the server closing the
/// connection under the client, which surfaces as a cancelled call or as a broken pipe deep in
/// the transport error's sources.
fn tls_mismatch(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        let m = cause.to_string().to_ascii_lowercase();
        let cancelled = cause
            .downcast_ref::<tonic::Status>()
            .is_some_and(|s| s.code() == tonic::Code::Cancelled);
        m.contains("h2 protocol error")
            || m.contains("broken pipe")
            || m.contains("connection reset")
            || (cancelled && m.contains("cancel"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_not_found_reads_as_the_coordinators_sentence() {
        let e = anyhow::Error::new(tonic::Status::not_found("no job job-99"));
        let text = format!("{:#}", explain(e, "127.0.0.1:7070"));
        assert_eq!(text, "no job job-99");
        let e = anyhow::Error::new(tonic::Status::not_found("no checkpoint at step 25"))
            .context("pulling job-1");
        let text = format!("{:#}", explain(e, "127.0.0.1:7070"));
        assert_eq!(text, "pulling job-1: no checkpoint at step 25");
    }

    #[test]
    fn unimplemented_says_it_is_not_a_coordinator() {
        let e = anyhow::Error::new(tonic::Status::unimplemented("")).context("listing jobs");
        let text = format!("{:#}", explain(e, "127.0.0.1:7071"));
        assert!(text.contains("not a Keel coordinator"), "{text}");
        assert!(text.contains("127.0.0.1:7071"), "{text}");
        assert!(!text.contains("Operation is not implemented"), "{text}");
    }

    #[test]
    fn errors_without_a_status_pass_through() {
        let e = anyhow::anyhow!("job.toml: no such file");
        assert_eq!(
            format!("{:#}", explain(e, "127.0.0.1:7070")),
            "job.toml: no such file"
        );
    }
}
