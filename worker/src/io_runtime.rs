//! The tokio runtime a worker's network runs on: the ring (its server, its connections to the
//! right neighbour, the all-reduce task), the calls to the coordinator and the metrics port.
//! The math runs on its own threads (`job`), never here.
//!
//! One thread by default. Every ring hop passes a frame between several tasks (the HTTP/2
//! connection reading the socket, the `Ring/Stream` call, the mailbox, the all-reduce, the link
//! to the right neighbour, the connection writing its socket); on a multi-threaded runtime those
//! tasks land on different threads, and each hand-off can wake a parked thread (a futex, and on
//! a VM an idle virtual CPU's wake-up). On one thread a hand-off is a queue push. Measured with
//! `scripts/bench-ring.sh` on a 2-core Intel Xeon (2026-12-04, medians of 3 alternated rounds;
//! "The ring on one thread" in the README): with 2 workers, 4 MiB at 2.91 GB/s bus bandwidth on
//! one thread against 1.49 on two, 16 MiB at 1.66 against 1.46; a hop of a 1-element
//! all-reduce takes 15-27 us with 2-4 workers against 19-56 us.
//! Links faster than one core can feed (25 Gbit/s on this Xeon, by the scale model) may want more:
//! `--io-threads`.

use tokio::runtime::{Builder, Runtime};

/// The default of `--io-threads`.
pub const DEFAULT_IO_THREADS: usize = 1;

/// The most `--io-threads` accepted: far above any network's need, and far below what would
/// exhaust the process's memory for thread stacks.
pub const MAX_IO_THREADS: usize = 64;

/// Parses `--io-threads` (clap's `value_parser`): a whole number from 1 to [`MAX_IO_THREADS`].
///
/// Errors: a message saying what was expected.
pub fn parse_io_threads(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_IO_THREADS).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected a whole number of threads from 1 to {MAX_IO_THREADS}, got {s:?}"
        )),
    }
}

/// A runtime with IO and timers for the network: `threads == 1` builds a current-thread
/// runtime, which runs every task on the thread that calls
/// [`Runtime::block_on`]; more builds a multi-threaded one with that many worker threads.
/// `spawn_blocking` works on both (the math uses it).
///
/// Errors: the OS refusing a thread or the IO driver (as [`Builder::build`]).
pub fn io_runtime(threads: usize) -> std::io::Result<Runtime> {
    if threads <= 1 {
        Builder::new_current_thread().enable_all().build()
    } else {
        Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::runtime::RuntimeFlavor;

    #[test]
    fn one_thread_is_a_current_thread_runtime_and_more_is_multi_threaded() {
        for (threads, flavor) in [
            (0, RuntimeFlavor::CurrentThread),
            (1, RuntimeFlavor::CurrentThread),
            (2, RuntimeFlavor::MultiThread),
        ] {
            let rt = io_runtime(threads).expect("runtime");
            assert_eq!(rt.handle().runtime_flavor(), flavor, "{threads} threads");
        }
    }

    #[test]
    fn io_threads_outside_1_to_64_are_refused_with_the_range() {
        assert_eq!(parse_io_threads("1"), Ok(1));
        assert_eq!(parse_io_threads("64"), Ok(64));
        for bad in ["0", "65", "100000", "-1", "abc", ""] {
            let err = parse_io_threads(bad).expect_err(bad);
            assert!(err.contains("from 1 to 64"), "{bad}: {err}");
        }
    }

    #[test]
    fn blocking_work_and_timers_run_beside_the_one_thread() {
        // The math runs in `spawn_blocking` and waits on the ring through channels; the one
        // network thread must keep serving timers and tasks meanwhile.
        let rt = io_runtime(1).expect("runtime");
        let sum = rt.block_on(async {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let math = tokio::task::spawn_blocking(move || rx.blocking_recv().expect("reply") + 1);
            let net_thread = std::thread::current().id();
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                assert_eq!(std::thread::current().id(), net_thread);
                tx.send(41u32).expect("send");
            });
            math.await.expect("join")
        });
        assert_eq!(sum, 42);
    }
}
