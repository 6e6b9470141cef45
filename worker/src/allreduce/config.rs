//! [`RingConfig`]: how one worker takes part in a ring, and the checks of its fields against
//! each other.

use std::time::Duration;

use super::error::AllReduceError;
use super::mailbox::MAX_FRAME_BYTES;

/// How one worker takes part in a ring. Every rank of a generation gets the same `job_id`,
/// `generation`, `world_size` and `peers`; `frame_bytes` must match too (frames are checked
/// against the receiver's plan).
#[derive(Clone, Debug)]
pub struct RingConfig {
    /// The job; frames of other jobs are refused.
    pub job_id: String,
    /// Membership generation; frames of older generations are refused.
    pub generation: u64,
    /// This worker's rank, `0..world_size`.
    pub rank: u32,
    /// Number of ranks in the ring (>= 1).
    pub world_size: u32,
    /// Advertised `host:port` of every rank, index = rank, in ring order; rank r sends to
    /// `peers[(r + 1) % world_size]`.
    pub peers: Vec<String>,
    /// HTTP/2 connections to the right neighbour (>= 1); frames are spread over them.
    pub streams_per_link: usize,
    /// Largest frame payload, bytes (a multiple of 4, at most 4 MiB); 256 KiB - 1 MiB works well.
    pub frame_bytes: usize,
    /// How long to wait for a peer without progress before failing (connecting, a frame from the
    /// left, the right accepting a frame).
    pub timeout: Duration,
}

impl RingConfig {
    /// Checks the fields against each other.
    ///
    /// Errors: [`AllReduceError::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<(), AllReduceError> {
        let bad = |reason: String| Err(AllReduceError::InvalidConfig { reason });
        if self.world_size == 0 {
            return bad("world_size must be at least 1".into());
        }
        if self.rank >= self.world_size {
            return bad(format!(
                "rank {} is not below world_size {}",
                self.rank, self.world_size
            ));
        }
        if self.peers.len() != self.world_size as usize {
            return bad(format!(
                "peers has {} addresses, expected world_size = {}",
                self.peers.len(),
                self.world_size
            ));
        }
        if self.streams_per_link == 0 {
            return bad("streams_per_link must be at least 1".into());
        }
        if self.frame_bytes < 4
            || !self.frame_bytes.is_multiple_of(4)
            || self.frame_bytes > MAX_FRAME_BYTES
        {
            return bad(format!(
                "frame_bytes {} must be a positive multiple of 4 up to {MAX_FRAME_BYTES}",
                self.frame_bytes
            ));
        }
        if self.timeout.is_zero() {
            return bad("timeout must be positive".into());
        }
        Ok(())
    }
}
