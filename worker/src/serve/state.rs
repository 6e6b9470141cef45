//! What this worker process is doing, across coordinator sessions (a coordinator restart ends
//! a session; the job and the held replica outlive it): one [`WorkerState`] behind one lock.

use crate::control::{JobControl, StopReason};
use crate::replica::{HeldReplica, Replica};
use keel_proto::rpc::TrainingKey;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The job running on this worker now.
#[derive(Debug)]
pub(super) struct Running {
    /// The job.
    pub(super) job_id: String,
    /// Its membership generation.
    pub(super) generation: u64,
    /// Stops it from outside.
    pub(super) control: Arc<JobControl>,
    /// Steps completed (advanced by the training loop).
    pub(super) progress: Arc<AtomicU64>,
    /// The training task has returned and is reporting how it ended: a stop asked now would
    /// never be seen by it, so [`Inner::stop_running`] leaves the answer to its caller.
    pub(super) ended: bool,
}

impl Running {
    /// `(job, generation, steps completed)`.
    fn key(&self) -> TrainingKey {
        TrainingKey {
            job_id: self.job_id.clone(),
            generation: self.generation,
            step: self.progress.load(Ordering::SeqCst),
        }
    }
}

/// The worker's state; every field is read and written under the one lock of
/// [`WorkerState`], so a decision that needs two of them sees them together.
#[derive(Debug, Default)]
pub(super) struct Inner {
    /// The worker id of the current registration (reports are sent under it).
    pub(super) worker_id: String,
    /// The job running now (one at a time).
    pub(super) running: Option<Running>,
    /// What the worker holds of a job between generations (protocol step 14).
    pub(super) held: Option<HeldReplica>,
}

impl Inner {
    /// `(job, generation, step)` of the job running, else of the replica held, for
    /// registration.
    pub(super) fn held_key(&self) -> Option<TrainingKey> {
        if let Some(r) = &self.running {
            return Some(r.key());
        }
        self.held.as_ref().map(|h| TrainingKey {
            job_id: h.job_id.clone(),
            generation: h.generation,
            step: h.replica.step,
        })
    }

    /// `(job, generation, steps completed)` of the running job, for heartbeats.
    pub(super) fn running_key(&self) -> Option<TrainingKey> {
        self.running.as_ref().map(Running::key)
    }

    /// The steps held of `job_id` (empty if none).
    pub(super) fn held_steps(&self, job_id: &str) -> Vec<u64> {
        self.held
            .as_ref()
            .filter(|h| h.job_id == job_id)
            .map(|h| vec![h.replica.step])
            .unwrap_or_default()
    }

    /// Stops the running job if it is `job_id` (any job if `None`) and its training task has
    /// not ended; whether one was stopped.
    pub(super) fn stop_running(&self, job_id: Option<&str>, reason: StopReason) -> bool {
        match &self.running {
            Some(run) if !run.ended && job_id.is_none_or(|j| j == run.job_id) => {
                run.control.stop(reason);
                true
            }
            _ => false,
        }
    }

    /// Takes the held replica if it is of `job_id`; a replica of another job is dropped (the
    /// coordinator moved on: free the memory).
    pub(super) fn take_held(&mut self, job_id: &str) -> Option<Replica> {
        match self.held.take() {
            Some(h) if h.job_id == job_id => Some(h.replica),
            _ => None,
        }
    }

    /// Forgets the running job if it is still `job_id` at `generation`.
    pub(super) fn clear_running(&mut self, job_id: &str, generation: u64) {
        if self
            .running
            .as_ref()
            .is_some_and(|r| r.job_id == job_id && r.generation == generation)
        {
            self.running = None;
        }
    }
}

/// [`Inner`] behind one lock, shared by the session tasks and the job's reporting task.
#[derive(Debug, Default)]
pub(super) struct WorkerState {
    inner: Mutex<Inner>,
}

impl WorkerState {
    /// Locks the state. A poisoned lock (a task panicked while holding it) is not skipped:
    /// every write under it is a whole assignment, so the data is still consistent; the
    /// panic is logged and the poison cleared, and the worker goes on with that data.
    pub(super) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| {
            tracing::error!(
                "the worker state's lock was poisoned (a task panicked while holding it); \
                 going on with the state as that task left it"
            );
            self.inner.clear_poison();
            poisoned.into_inner()
        })
    }

    /// The worker id of the current registration.
    pub(super) fn worker_id(&self) -> String {
        self.lock().worker_id.clone()
    }

    /// Whether a job is running (its task has not yet reported how it ended).
    pub(super) fn is_running(&self) -> bool {
        self.lock().running.is_some()
    }

    /// See [`Inner::stop_running`].
    pub(super) fn stop_running(&self, job_id: Option<&str>, reason: StopReason) -> bool {
        self.lock().stop_running(job_id, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(state: &WorkerState, job: &str, generation: u64) -> Arc<JobControl> {
        let control = Arc::new(JobControl::new());
        state.lock().running = Some(Running {
            job_id: job.into(),
            generation,
            control: control.clone(),
            progress: Arc::new(AtomicU64::new(7)),
            ended: false,
        });
        control
    }

    #[test]
    fn a_poisoned_lock_is_recovered_with_its_data() {
        let state = Arc::new(WorkerState::default());
        state.lock().worker_id = "w-1".into();
        let s = state.clone();
        let panicked = std::thread::spawn(move || {
            let _guard = s.lock();
            panic!("a task panics while holding the lock");
        })
        .join();
        assert!(panicked.is_err());
        assert!(state.inner.is_poisoned());
        assert_eq!(state.worker_id(), "w-1");
        assert!(!state.inner.is_poisoned());
    }

    #[test]
    fn stops_reach_only_the_named_job_until_it_has_ended() {
        let state = WorkerState::default();
        assert!(!state.stop_running(None, StopReason::Cancel));
        let control = running(&state, "a", 1);
        assert!(!state.stop_running(Some("b"), StopReason::Cancel));
        assert!(control.reason().is_none());
        assert_eq!(state.lock().held_key().map(|k| k.step), Some(7));
        state.lock().running.as_mut().unwrap().ended = true;
        assert!(!state.stop_running(Some("a"), StopReason::Cancel));
        state.lock().running.as_mut().unwrap().ended = false;
        assert!(state.stop_running(Some("a"), StopReason::Cancel));
        assert_eq!(control.reason(), Some(StopReason::Cancel));
        state.lock().clear_running("a", 2);
        assert!(state.is_running());
        state.lock().clear_running("a", 1);
        assert!(!state.is_running());
    }
}
