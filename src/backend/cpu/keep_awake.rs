//! Keeps the CPU pool's workers awake through one forward step, so that its parallel loops do
//! not each wait for a sleeping thread to wake, and lets the step's thread share small calls
//! (matmuls of a few tokens, short-context decode attention) with them at less cost than a
//! rayon loop ([`parts`]).
//!
//! A decode step is a few hundred short parallel loops (a SmolLM2 matmul is 5–300 µs) with
//! serial work between them (norms, activations, rope). rayon's idle workers look for work with
//! `sched_yield` for a few microseconds and then sleep on a futex, and a sleeping thread joins
//! the next loop only after its wake-up, which a virtual machine delivers late: on the 2-vCPU
//! Intel Xeon development machine a loop of eight 10 µs tasks after 10 µs or more of serial work
//! took ~25 µs longer than after none (the caller ran most tasks before the worker arrived),
//! and a SmolLM2 Q4_1 decode step of 16 sequences ran 1.55× faster on 2 threads than on 1.
//!
//! So each step puts a *keeper* on every other worker: it takes its part of the step's team
//! work as soon as it is posted, runs the pool's pending jobs as they appear
//! (`rayon::yield_now`), and between them polls with the CPU's spin hint, no system call. It
//! never spins against another process for long: it leaves when the step ends, after [`SPIN`]
//! without a job, or as soon as a poll finds that its thread lost the CPU for [`PREEMPTED`]
//! (the machine is shared, or its vCPU was descheduled), and then the worker behaves as
//! rayon's always do (and [`members`] sends the step's work back to rayon loops).

use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
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
    let team = Arc::new(Team::new(threads, threads <= cpus()));
    // Set when `step` returns or unwinds, so no keeper outlives it by more than a poll; the
    // step's thread forgets the team at the same time.
    struct Finish(Arc<Team>, *const Team);
    impl Drop for Finish {
        fn drop(&mut self) {
            self.0.done.store(true, Ordering::Release);
            TEAM.set(self.1);
        }
    }
    let finish = Finish(Arc::clone(&team), TEAM.replace(Arc::as_ptr(&team)));
    if team.parts {
        // A keeper on each other thread of the pool, numbered from 1 (none for threads beyond
        // the step's count).
        let keepers = Arc::clone(&team);
        rayon::spawn_broadcast(move |ctx| {
            let i = ctx.index();
            let member = if i < home { i + 1 } else { i };
            if i != home && member < keepers.members {
                keep(&keepers, member);
            }
        });
    } else {
        // More threads than CPUs: keepers for rayon's jobs only, queued as jobs that any worker
        // takes, the step's own thread included (where one leaves at once). A keeper on every
        // other worker, as the broadcast puts them, spun against the working threads: 4 threads
        // on the 2-vCPU Xeon, SmolLM2 Q4_1 decode ran 307–338 tok/s with the parts and 307–320
        // without them, against 363–374 this way (367–377 before the team).
        for member in 1..threads {
            let keepers = Arc::clone(&team);
            rayon::spawn(move || {
                if rayon::current_thread_index() != Some(home) {
                    keep(&keepers, member);
                }
            });
        }
    }
    let result = step();
    drop(finish);
    result
}

thread_local! {
    /// The team of the step this thread runs: set by [`during`] on the step's own thread, null
    /// elsewhere and while [`parts`] runs a part.
    static TEAM: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
}

/// How many parts [`parts`] would run on this thread now: the step's threads when this is a
/// step's own thread, the step has no more threads than the process has CPUs, and every keeper
/// is polling; else 0 (use the rayon pool). With more threads than CPUs a fixed part may wait
/// for a thread that shares a core, where rayon's stealing moves the work; and the keepers the
/// parts need, one broadcast to every worker, cost that case most of all (see [`during`]).
pub fn members() -> usize {
    let team = TEAM.get();
    if team.is_null() {
        return 0;
    }
    // SAFETY: set by `during` on this thread from an `Arc` it holds until it resets the pointer.
    let team = unsafe { &*team };
    if team.parts && team.present.0.load(Ordering::Acquire) + 1 == team.members {
        team.members
    } else {
        0
    }
}

/// `part(i)` for every `i` in `0..n`, `n` the step's threads (what [`members`] returned, when it
/// returned 2 or more): part 0 on the calling thread, part `i` on keeper `i` if it takes it
/// before the caller has finished its own part, else on the caller after its own. Returns when
/// every part has finished; a part's panic is raised here after all have. Panics outside a
/// step's own thread (where [`members`] is 0).
///
/// Why not a rayon loop: a one-token matmul of a small model takes 5–25 µs, and on the 2-vCPU
/// Xeon (family 6 model 207) a rayon loop of four 2.5 µs tasks took ~1.4 µs beyond them (the
/// caller's first task started 0.2 µs into the loop, the other thread's 0.5 µs, 0.2 µs between
/// one thread's tasks, 0.4 µs to notice the last one's end). Here a part is posted by one store,
/// claimed by one compare-and-swap of the keeper's own line, and its end is one store to that
/// line; the parts are fixed (a matmul's even but for the caller's lead, since the keepers start
/// later: `matmul::TeamRows`), which for one-token matmuls balanced as well as rayon's stealing
/// (letting a quarter of a large call go to whichever thread got there first measured 2–3%
/// slower). SmolLM2 decode, 128 steps, 2 threads, one process alternating rayon loops and
/// parts, 30 rounds, median per-round ratio: Q4_1 int24 1.037–1.039.
pub fn parts(part: &(dyn Fn(usize) + Sync)) {
    let team = TEAM.replace(std::ptr::null());
    assert!(
        !team.is_null(),
        "keep_awake::parts outside a step's own thread"
    );
    // Restores the pointer however this ends.
    struct Restore(*const Team);
    impl Drop for Restore {
        fn drop(&mut self) {
            TEAM.set(self.0);
        }
    }
    let _restore = Restore(team);
    // SAFETY: as in `members`.
    unsafe { &*team }.run(part);
}

/// Polls of a keeper's part before the step's thread yields between them: ~50–100 µs of spin
/// hints, far longer than a keeper's part outlasts the caller's when both run (a few µs).
const WAIT_SPINS: u32 = 1 << 13;

/// Pads a value to its own pair of cache lines (the adjacent-line prefetcher fetches pairs), so
/// that the threads writing different fields do not pass lines back and forth.
#[repr(align(128))]
struct Padded<T>(T);

/// One keeper's part of the current job.
#[derive(Default)]
struct Slot {
    /// The last job whose part was claimed: its sequence number shifted left by one, the low
    /// bit set when the keeper claimed it (else the step's thread did).
    claimed: AtomicU64,
    /// The last sequence number whose part the keeper finished.
    finished: AtomicU64,
}

/// The CPUs this process may run on (1 when unknown), asked once.
fn cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// A step's team: the step's thread posts a job, each keeper claims its part.
struct Team {
    members: usize,
    /// Whether [`members`] offers the team's parts (no more threads than CPUs).
    parts: bool,
    /// The current job's sequence number (0: none yet), and the job.
    post: Padded<(AtomicU64, AtomicPtr<Job<'static>>)>,
    /// Slot `i - 1` for keeper `i`.
    slots: Box<[Padded<Slot>]>,
    /// Keepers polling now.
    present: Padded<AtomicUsize>,
    /// Set when a part panicked on a keeper.
    panicked: AtomicBool,
    /// Set when the step ends: keepers leave.
    done: AtomicBool,
}

/// What a part runs: a reference to the caller's closure, on its stack.
struct Job<'a> {
    part: &'a (dyn Fn(usize) + Sync),
}

impl Team {
    fn new(members: usize, parts: bool) -> Team {
        Team {
            members,
            parts,
            post: Padded((AtomicU64::new(0), AtomicPtr::new(std::ptr::null_mut()))),
            slots: (1..members).map(|_| Padded(Slot::default())).collect(),
            present: Padded(AtomicUsize::new(0)),
            panicked: AtomicBool::new(false),
            done: AtomicBool::new(false),
        }
    }

    /// Runs the parts of one job (see [`parts`]).
    fn run(&self, part: &(dyn Fn(usize) + Sync)) {
        let job = Job { part };
        let seq = self.post.0 .0.load(Ordering::Relaxed) + 1;
        // SAFETY (of the lifetime change): a keeper reads the job only after claiming a part of
        // it, and this function returns or unwinds only after every claimed part has finished.
        let ptr = &job as *const Job<'_> as *mut Job<'static>;
        self.post.0 .1.store(ptr, Ordering::Relaxed);
        self.post.0 .0.store(seq, Ordering::Release);
        // However this ends: no part is left for a keeper to claim, and every part a keeper
        // claimed has finished.
        struct Close<'a>(&'a Team, u64);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                for slot in self.0.slots.iter() {
                    let slot = &slot.0;
                    if !slot.claim(self.1, false) && slot.claimed_by_keeper(self.1) {
                        slot.wait_finished(self.1);
                    }
                }
                if std::thread::panicking() {
                    // This thread's part failed too: a keeper's failure is not left for the
                    // next call to report.
                    self.0.panicked.store(false, Ordering::Relaxed);
                }
            }
        }
        let close = Close(self, seq);
        part(0);
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.0.claim(seq, false) {
                part(i + 1);
            }
        }
        drop(close);
        if self.panicked.swap(false, Ordering::Relaxed) {
            panic!("a part of a parallel call panicked on a keeper thread");
        }
    }

    /// On keeper `member`: claims and runs its part of the posted job if it has not been
    /// claimed; whether it ran one. `seen` is the last sequence number it looked at.
    fn help(&self, member: usize, seen: &mut u64) -> bool {
        let seq = self.post.0 .0.load(Ordering::Acquire);
        if seq == *seen {
            return false;
        }
        *seen = seq;
        let slot = &self.slots[member - 1].0;
        if !slot.claim(seq, true) {
            return false;
        }
        // SAFETY: a claimed part keeps its job alive (see `run`); the pointer was stored before
        // the sequence number this thread read with Acquire.
        let job = unsafe { &*self.post.0 .1.load(Ordering::Relaxed) };
        if std::panic::catch_unwind(AssertUnwindSafe(|| (job.part)(member))).is_err() {
            self.panicked.store(true, Ordering::Relaxed);
        }
        slot.finished.store(seq, Ordering::Release);
        true
    }
}

impl Slot {
    /// Claims this slot's part of job `seq` for the keeper or the step's thread; false when it
    /// was already claimed. `claimed` holds `seq << 1`, its low bit set when a keeper claimed.
    fn claim(&self, seq: u64, keeper: bool) -> bool {
        let before = self.claimed.load(Ordering::Acquire);
        before >> 1 < seq
            && self
                .claimed
                .compare_exchange(
                    before,
                    seq << 1 | keeper as u64,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    /// Waits until the keeper has finished its part of job `seq`: spinning, then (a keeper
    /// descheduled mid-part, say on a machine shared with other work) yielding the CPU between
    /// polls.
    fn wait_finished(&self, seq: u64) {
        let mut spins = 0u32;
        while self.finished.load(Ordering::Acquire) < seq {
            if spins < WAIT_SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Whether a keeper claimed this slot's part of job `seq`.
    fn claimed_by_keeper(&self, seq: u64) -> bool {
        self.claimed.load(Ordering::Acquire) == (seq << 1 | 1)
    }

    /// On the keeper, between jobs (where [`write_prefetch`] says the CPU has the
    /// instruction): asks for this slot's line in a state it may write, so that the claim of
    /// the next part is a compare-and-swap in the keeper's own cache rather than a request to
    /// the step's thread, which read the line when it last waited. A hint: no effect on what
    /// any thread sees. A keeper's claim came ~0.37 µs after the post without it and ~0.25 µs
    /// with it (SmolLM2 Q4_1 decode, 2 threads of the 2-vCPU Xeon, family 6 model 207); the
    /// decode, one process alternating, 60 rounds of 128 steps, median per-round ratio 1.006
    /// (quartiles 1.000–1.017; 1.009 over 20 rounds), Qwen2.5-Coder-0.5B Q4_K_M 1.003 (within
    /// its spread).
    #[inline(always)]
    fn own_ahead(&self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `write_prefetch` found the instruction; a prefetch reads nothing, writes
        // nothing and never faults.
        unsafe {
            std::arch::asm!(
                "prefetchw [{0}]",
                in(reg) &self.claimed as *const AtomicU64,
                options(nostack, readonly, preserves_flags)
            )
        };
    }
}

/// Whether the CPU has `prefetchw` (PRFCHW: CPUID leaf 0x8000_0001, ECX bit 8), which
/// [`Slot::own_ahead`] issues. Asked once (under a hypervisor `cpuid` exits to it).
fn write_prefetch() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        static HAS: OnceLock<bool> = OnceLock::new();
        // Leaf 0x8000_0000 (the highest extended leaf) exists on every x86-64 CPU.
        *HAS.get_or_init(|| {
            __cpuid(0x8000_0000).eax >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 8) != 0
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Keeper `member` (1 or more): runs its part of each of its team's jobs and the pool's jobs
/// as they come until the step is `done`, it has idled for [`SPIN`], or its thread was
/// preempted.
fn keep(team: &Team, member: usize) {
    // Counted present while polling; the step's thread posts parts only while all are.
    team.present.0.fetch_add(1, Ordering::AcqRel);
    struct Leave<'a>(&'a AtomicUsize);
    impl Drop for Leave<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::AcqRel);
        }
    }
    let _leave = Leave(&team.present.0);
    let mut seen = 0;
    let mut last_job = Instant::now();
    let mut last_poll = last_job;
    let slot = &team.slots[member - 1].0;
    let own_ahead = write_prefetch();
    while !team.done.load(Ordering::Acquire) {
        if team.help(member, &mut seen) {
            last_job = Instant::now();
            last_poll = last_job;
            continue;
        }
        if own_ahead {
            slot.own_ahead();
        }
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

/// On a step's own thread: waits (up to two seconds, running rayon loops meanwhile so the
/// keepers see work) until every keeper of the step is polling; whether they all were.
#[cfg(test)]
pub(crate) fn keepers_present(threads: usize) -> bool {
    use rayon::prelude::*;
    let start = Instant::now();
    while members() != threads {
        if start.elapsed() > Duration::from_secs(2) {
            return false;
        }
        (0..threads)
            .into_par_iter()
            .for_each(|_| std::hint::spin_loop());
    }
    true
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

    /// Every part of every call runs exactly once and has finished when `parts` returns, on
    /// whichever thread takes it; calls nest (a part's own `members` is 0).
    #[test]
    fn parts_run_each_part_once_and_finish_before_returning() {
        for threads in [2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                during(threads, || {
                    assert!(members() == 0 || members() == threads);
                    if !keepers_present(threads) {
                        println!("note: the keepers did not all arrive; parts ran on this thread");
                    }
                    let counts: Vec<AtomicUsize> =
                        (0..threads).map(|_| AtomicUsize::new(0)).collect();
                    let keepers_took = AtomicUsize::new(0);
                    let home = std::thread::current().id();
                    for call in 1..=2000 {
                        parts(&|i| {
                            assert_eq!(members(), 0, "a part's own calls go to rayon");
                            counts[i].fetch_add(1, Ordering::Relaxed);
                            if std::thread::current().id() != home {
                                keepers_took.fetch_add(1, Ordering::Relaxed);
                            }
                        });
                        for (i, c) in counts.iter().enumerate() {
                            assert_eq!(c.load(Ordering::Relaxed), call, "part {i} of call {call}");
                        }
                    }
                    println!(
                        "{threads} threads: keepers took {} of {} parts",
                        keepers_took.load(Ordering::Relaxed),
                        2000 * (threads - 1)
                    );
                })
            });
        }
    }

    /// A part's panic, on a keeper or on the step's thread, reaches the caller of `parts` after
    /// the other parts have finished, and the team goes on working.
    #[test]
    fn a_panicking_part_unwinds_to_the_caller_and_the_team_goes_on() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        pool.install(|| {
            during(2, || {
                keepers_present(2);
                for bad in [0, 1, 0, 1] {
                    let (started, done) = (AtomicBool::new(false), AtomicBool::new(false));
                    let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        parts(&|i| {
                            if i == bad {
                                panic!("part {i} failed");
                            }
                            started.store(true, Ordering::Release);
                            std::thread::sleep(Duration::from_millis(5));
                            done.store(true, Ordering::Release);
                        })
                    }));
                    assert!(r.is_err(), "part {bad}'s panic reached the caller");
                    // Part 0 always runs; part 1 may not once part 0 has failed, but no part
                    // is still running.
                    let (started, done) = (started.into_inner(), done.into_inner());
                    assert_eq!(started, done, "part {bad} failed: the other one had ended");
                    assert!(bad == 0 || done, "part 0 ran");
                    let ran = AtomicUsize::new(0);
                    parts(&|_| {
                        ran.fetch_add(1, Ordering::Relaxed);
                    });
                    assert_eq!(ran.load(Ordering::Relaxed), 2);
                }
            })
        });
    }

    /// A step that uses fewer threads than its pool has a keeper for each of its other parts,
    /// whichever worker runs the step.
    #[test]
    fn a_step_on_part_of_its_pool_runs_its_parts() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for _ in 0..20 {
            let (counts, keepers) = pool.install(|| {
                during(2, || {
                    let counts = [AtomicUsize::new(0), AtomicUsize::new(0)];
                    for _ in 0..100 {
                        parts(&|i| {
                            counts[i].fetch_add(1, Ordering::Relaxed);
                        });
                    }
                    (counts.map(AtomicUsize::into_inner), members())
                })
            });
            assert_eq!(counts, [100, 100]);
            assert!(keepers == 0 || keepers == 2);
        }
    }

    #[test]
    fn members_is_zero_outside_a_step() {
        assert_eq!(members(), 0);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        assert_eq!(pool.install(members), 0);
        // One thread: no team.
        assert_eq!(pool.install(|| during(1, members)), 0);
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
