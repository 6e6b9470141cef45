//! This machine's name, as a worker registers it and as TensorBoard event files are named.

/// This machine's name: `$HOSTNAME` (a shell variable that is seldom exported), else the
/// kernel's (`/proc/sys/kernel/hostname`), trimmed; empty only when neither exists.
pub fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.trim().is_empty())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_name_has_no_surrounding_whitespace() {
        let name = super::hostname();
        assert_eq!(name, name.trim());
    }
}
