//! At most one log line per interval for events a stranger can cause at will (refused calls,
//! refused connections, accept errors), so that a flood of them cannot fill the disk or drown
//! the log; the line that is written says how many were left out since the last one.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A limiter for one kind of log line: [`LogLimit::check`] says whether to write it now.
#[derive(Debug)]
pub struct LogLimit {
    /// Shortest time between two written lines.
    interval: Duration,
    /// When the last line was written (`None`: never) and how many were suppressed since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimit {
    /// A limiter writing at most one line per `interval` (usable in a `static`).
    pub const fn new(interval: Duration) -> LogLimit {
        LogLimit {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(suppressed)` if a line may be written now (then `suppressed` lines were left out
    /// since the last written one), `None` if this one is to be left out (and counted).
    pub fn check(&self) -> Option<u64> {
        self.check_at(Instant::now())
    }

    /// [`LogLimit::check`] at the time `now` (for tests).
    pub fn check_at(&self, now: Instant) -> Option<u64> {
        // A panic while holding the lock cannot leave the pair inconsistent: use it anyway.
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (last, suppressed) = &mut *state;
        match last {
            Some(t) if now.saturating_duration_since(*t) < self.interval => {
                *suppressed = suppressed.saturating_add(1);
                None
            }
            _ => {
                *last = Some(now);
                Some(std::mem::take(suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_the_count_of_the_left_out_ones() {
        let limit = LogLimit::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(limit.check_at(t0), Some(0));
        for i in 1..=999u64 {
            assert_eq!(limit.check_at(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(limit.check_at(t0 + Duration::from_millis(9_999)), None);
        // The next line after the interval reports the 1,000 left out.
        assert_eq!(limit.check_at(t0 + Duration::from_secs(10)), Some(1000));
        assert_eq!(limit.check_at(t0 + Duration::from_secs(11)), None);
        assert_eq!(limit.check_at(t0 + Duration::from_secs(25)), Some(1));
        // A clock that goes backwards (another thread's earlier `now`) is just suppressed.
        assert_eq!(limit.check_at(t0), None);
    }
}
