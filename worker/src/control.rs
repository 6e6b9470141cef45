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
        if let Ok(mut r) = self.reason.lock() {
            match *r {
                None => *r = Some(reason),
                Some(StopReason::Suspend { .. }) if reason == StopReason::Cancel => {
                    *r = Some(reason)
                }
                Some(_) => {}
            }
        }
        self.stopped.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// Whether the job was stopped.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Why it was stopped, if it was.
    pub fn reason(&self) -> Option<StopReason> {
        self.reason.lock().ok().and_then(|r| *r)
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
