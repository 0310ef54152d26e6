//! Where a step's parallel loops run: on the backend's rayon pool, or (a backend of one
//! thread) on the thread that called the step, one item after another.
//!
//! A step on the pool is handed to one of its workers, and the caller sleeps until the worker
//! hands it back; a sleeping thread wakes late on a virtual machine. On the 2-vCPU AMD EPYC
//! Zen 5 (family 26 model 2), SmolLM2 Q4_1 decode at one thread: timers around the hand-over
//! put ~41 µs between the call and the worker's start and ~85 µs between the step's end and
//! the caller's return, and a step's wall time exceeded the sum of its instructions' times by
//! 146 µs on the pool against 34 µs on the calling thread (10 rounds of 128 steps). One process
//! alternating the two, 60 rounds of 128 steps, median per-round ratio 1.059 (quartiles
//! 1.023–1.096). A backend of one thread has no other thread to share its loops with, so its
//! steps run on the calling thread ([`serially`]) and every loop here runs there in order.
//! Each item does the same arithmetic on either path: the logits are the same bits.
//!
//! Steps of more threads still go to the pool: their loops need its workers. (The calling
//! thread as the step's thread and the workers as its team's keepers, lingering between steps,
//! was tried on the same machine at two threads: ~50–70 µs less outside the instructions, but a
//! keeper that had left, descheduled or idle, was back only after a wake-up, and the parts
//! it missed ran on the calling thread after its own: 7–13% of them, 2–3% with keepers that
//! left only when switched out; ten processes of each alternating, median per-pair ratio
//! 0.94: slower.)
//!
//! Every loop of a step goes through these functions rather than calling rayon itself: a rayon
//! loop started on a thread outside the backend's pool would run on rayon's global pool
//! (`tests/serial_step.rs` checks that none does).

use std::cell::Cell;

use rayon::prelude::*;

thread_local! {
    /// Set while this thread runs a step of a one-thread backend ([`serially`]).
    static SERIAL: Cell<bool> = const { Cell::new(false) };
}

/// Runs `step` with every loop of this module in order on this thread (see the module's
/// documentation), and [`threads`] 1.
pub fn serially<R>(step: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SERIAL.set(self.0);
        }
    }
    let _restore = Restore(SERIAL.replace(true));
    step()
}

/// Whether this thread runs a step of a one-thread backend ([`serially`]).
fn serial() -> bool {
    SERIAL.get()
}

/// The threads a step's loops share: 1 in a [`serially`] step, else the current rayon pool's.
pub fn threads() -> usize {
    if serial() {
        1
    } else {
        rayon::current_num_threads().max(1)
    }
}

/// `f(item)` for every item: in order on this thread in a [`serially`] step, else a rayon loop.
pub fn for_each<I, T>(items: I, f: impl Fn(T) + Sync + Send)
where
    I: IntoParallelIterator<Item = T> + IntoIterator<Item = T>,
    T: Send,
{
    if serial() {
        items.into_iter().for_each(f)
    } else {
        items.into_par_iter().for_each(f)
    }
}

/// `f(item)` of every item, in the items' order (see [`for_each`]).
pub fn map_collect<I, T, U>(items: I, f: impl Fn(T) -> U + Sync + Send) -> Vec<U>
where
    I: IntoParallelIterator<Item = T> + IntoIterator<Item = T>,
    T: Send,
    U: Send,
{
    if serial() {
        items.into_iter().map(f).collect()
    } else {
        items.into_par_iter().map(f).collect()
    }
}

/// `f(i, chunk i)` for `data` cut into chunks of `size` (the last may be shorter; see
/// [`for_each`]).
pub fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    size: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    if serial() {
        data.chunks_mut(size)
            .enumerate()
            .for_each(|(i, chunk)| f(i, chunk))
    } else {
        data.par_chunks_mut(size)
            .enumerate()
            .for_each(|(i, chunk)| f(i, chunk))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn a_serial_step_runs_every_loop_in_order_on_its_own_thread() {
        let me = std::thread::current().id();
        let seen = Mutex::new(Vec::new());
        let (squares, chunks) = serially(|| {
            assert!(serial());
            assert_eq!(threads(), 1);
            for_each(0..100usize, |i| {
                assert_eq!(std::thread::current().id(), me);
                seen.lock().unwrap().push(i);
            });
            let squares = map_collect(0..10usize, |i| i * i);
            let mut data = vec![0usize; 10];
            for_each_chunk_mut(&mut data, 3, |i, c| c.iter_mut().for_each(|x| *x = i));
            (squares, data)
        });
        assert!(!serial(), "the flag ends with the step");
        assert_eq!(*seen.lock().unwrap(), (0..100).collect::<Vec<_>>());
        assert_eq!(squares, (0..10).map(|i| i * i).collect::<Vec<_>>());
        assert_eq!(chunks, vec![0, 0, 0, 1, 1, 1, 2, 2, 2, 3]);
    }

    #[test]
    fn outside_a_serial_step_loops_run_on_the_current_pool() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        pool.install(|| {
            assert_eq!(threads(), 3);
            let on_pool = map_collect(0..64usize, |_| rayon::current_thread_index().is_some());
            assert!(on_pool.iter().all(|&p| p));
            let mut data = vec![0usize; 10];
            for_each_chunk_mut(&mut data, 4, |i, c| c.iter_mut().for_each(|x| *x = i));
            assert_eq!(data, vec![0, 0, 0, 0, 1, 1, 1, 1, 2, 2]);
        });
    }

    #[test]
    fn a_panicking_serial_step_clears_the_flag() {
        let r = std::panic::catch_unwind(|| serially(|| panic!("step failed")));
        assert!(r.is_err());
        assert!(!serial());
    }
}
