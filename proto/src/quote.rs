//! Quoting untrusted input in messages: at most a bounded prefix of it.
//!
//! An error that quotes what a client sent (a TOML key, a path, a job's origin) would
//! otherwise carry it whole: a 4 MB key came back as a 14 MB `grpc-message`. Every `Status`
//! the coordinator sends goes through [`bounded`] with [`MAX_MESSAGE_BYTES`], and the job
//! file's parse errors quote at most that much of toml's message.

/// Bytes of an error message kept before it is cut (1 KiB: a key, a path and the reason fit;
/// a quoted megabyte does not).
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// `text` when it holds at most `max` bytes; else its first `max` bytes (cut at a character
/// boundary) followed by `… (N bytes more)`.
pub fn bounded(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes more)", &text[..end], text.len() - end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_cut_at_a_character_boundary_and_says_how_much_is_left() {
        assert_eq!(bounded("short", 10), "short");
        assert_eq!(bounded("abcdef", 4), "abcd… (2 bytes more)");
        // 'é' is two bytes: a cut inside it moves back to the boundary.
        assert_eq!(bounded("aéb", 2), "a… (3 bytes more)");
    }
}
