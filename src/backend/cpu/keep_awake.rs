//! Keeps the CPU pool's workers awake through one forward step, so that its parallel loops do
//! not each wait for a sleeping thread to wake.
//!
//! A decode step is a few hundred short parallel loops (a SmolLM2 matmul is 20–300 µs) with
//! serial work between them (norms, activations, rope). rayon's idle workers look for work with
//! `sched_yield` for a few microseconds and then sleep on a futex, and a sleeping thread joins
//! the next loop only after its wake-up, which a virtual machine delivers late: on the 2-vCPU
//! Intel Xeon development machine a loop of eight 10 µs tasks after 10 µs or more of serial work
//! took ~25 µs longer than after none (the caller ran most tasks before the worker arrived),
//! and a SmolLM2 Q4_1 decode step of 16 sequences ran 1.55× faster on 2 threads than on 1.
//!
//! So each step puts a *keeper* job on every other worker: it runs the pool's pending jobs as
//! they appear (`rayon::yield_now`) and between them polls with the CPU's spin hint, no system
//! call. It never spins against another process for long: it leaves when the step ends, after
//! [`SPIN`] without a job, or as soon as a poll finds that its thread lost the CPU for
//! [`PREEMPTED`] (the machine is shared, or its vCPU was descheduled), and then the worker
//! behaves as rayon's always do.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a keeper polls without finding a job before it leaves: longer than the serial
/// stretches of a step (a few to a few tens of microseconds), short enough that a step that
/// ends in long serial work wastes little.
pub const SPIN: Duration = Duration::from_micros(250);

/// A gap between two polls this long means the keeper's thread was descheduled: something else
/// wants the CPU, so the keeper leaves rather than spin against it.
pub const PREEMPTED: Duration = Duration::from_micros(50);

/// Runs `step` (on a thread of the current rayon pool, whose `threads` threads it uses) with a
/// keeper on each other worker until `step` returns.
pub fn during<R>(threads: usize, step: impl FnOnce() -> R) -> R {
    let home = match rayon::current_thread_index() {
        Some(i) if threads >= 2 => i,
        _ => return step(),
    };
    let done = Arc::new(AtomicBool::new(false));
    // Set when `step` returns or unwinds, so no keeper outlives it by more than a poll.
    struct Finish(Arc<AtomicBool>);
    impl Drop for Finish {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let finish = Finish(Arc::clone(&done));
    for _ in 1..threads {
        let done = Arc::clone(&done);
        rayon::spawn(move || keep(&done, home));
    }
    let result = step();
    drop(finish);
    result
}

/// A keeper: runs the pool's jobs as they come until the step is `done`, it has idled for
/// [`SPIN`], or its thread was preempted. On the step's own thread (which took its own job back
/// while waiting for a loop's tasks) it leaves at once.
fn keep(done: &AtomicBool, home: usize) {
    if rayon::current_thread_index() == Some(home) {
        return;
    }
    let mut last_job = Instant::now();
    let mut last_poll = last_job;
    while !done.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => {
                last_job = Instant::now();
                last_poll = last_job;
            }
            _ => {
                let now = Instant::now();
                if now.duration_since(last_poll) >= PREEMPTED
                    || now.duration_since(last_job) >= SPIN
                {
                    return;
                }
                last_poll = now;
                std::hint::spin_loop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn a_step_runs_with_keepers_and_returns_its_result() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let sum: u64 = pool.install(|| {
            during(3, || {
                (0..50u64)
                    .map(|i| (0..1000u64).into_par_iter().map(|j| i * j).sum::<u64>())
                    .sum()
            })
        });
        assert_eq!(sum, (0..50u64).sum::<u64>() * (0..1000u64).sum::<u64>());
    }

    #[test]
    fn a_panicking_step_unwinds_to_its_caller_and_frees_the_pool() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| during(2, || panic!("step failed")))
        }));
        assert!(r.is_err());
        let (tx, rx) = std::sync::mpsc::channel();
        pool.spawn(move || tx.send(()).unwrap());
        assert!(rx.recv_timeout(Duration::from_secs(5)).is_ok());
    }
}
