//! How the worker process stops a job's training loop from outside: the coordinator cancels
//! it or suspends it (a new generation is forming), or the process is shutting down. The
//! flag is read between steps; the notification aborts an all-reduce the loop is blocked in,
//! so a suspended rank answers at once instead of after the ring timeout.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::Notify;

/// Why a job was stopped from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The coordinator ended the job: drop its state.
    Cancel,
    /// The coordinator is forming generation `generation`: keep the state and report it.
    Suspend {
        /// The new generation.
        generation: u64,
    },
    /// This worker process is exiting (SIGTERM/SIGINT).
    Shutdown,
}

/// A job's stop switch, shared by the worker process and the job's threads.
#[derive(Debug, Default)]
pub struct JobControl {
    stopped: AtomicBool,
    reason: Mutex<Option<StopReason>>,
    notify: Notify,
}

impl JobControl {
    /// A switch that is not set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stops the job for `reason`. The first reason wins, except that a cancel overrides a
    /// suspend (the state is then dropped).
    pub fn stop(&self, reason: StopReason) {
        let mut r = self.lock_reason();
        match *r {
            None => *r = Some(reason),
            Some(StopReason::Suspend { .. }) if reason == StopReason::Cancel => *r = Some(reason),
            Some(_) => {}
        }
        drop(r);
        self.stopped.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// Whether the job was stopped.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Why it was stopped, if it was.
    pub fn reason(&self) -> Option<StopReason> {
        *self.lock_reason()
    }

    /// The reason's lock. A panic while it was held poisons it; the `Option` inside is
    /// written whole, so it is still right: logged, and used.
    fn lock_reason(&self) -> std::sync::MutexGuard<'_, Option<StopReason>> {
        self.reason.lock().unwrap_or_else(|poisoned| {
            tracing::error!("a job's stop-reason lock was poisoned by a panic; carrying on");
            poisoned.into_inner()
        })
    }

    /// Resolves once the job is stopped (at once if it already is).
    pub async fn stopped(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_stopped() {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancel_overrides_a_suspend_and_nothing_else_overrides() {
        let c = JobControl::new();
        assert_eq!(c.reason(), None);
        c.stop(StopReason::Suspend { generation: 2 });
        c.stop(StopReason::Shutdown);
        assert_eq!(c.reason(), Some(StopReason::Suspend { generation: 2 }));
        c.stop(StopReason::Cancel);
        c.stop(StopReason::Suspend { generation: 3 });
        assert_eq!(c.reason(), Some(StopReason::Cancel));
        assert!(c.is_stopped());
    }

    #[test]
    fn a_poisoned_reason_lock_still_stops_and_tells_why() {
        let c = std::sync::Arc::new(JobControl::new());
        let c2 = c.clone();
        let _ = std::thread::spawn(move || {
            let _held = c2.reason.lock();
            panic!("poison the lock");
        })
        .join();
        assert!(c.reason.is_poisoned());
        c.stop(StopReason::Suspend { generation: 4 });
        assert!(c.is_stopped());
        assert_eq!(c.reason(), Some(StopReason::Suspend { generation: 4 }));
    }
}
