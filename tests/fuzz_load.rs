//! The loader fuzzer's stable-Rust driver (mutators and the per-case run live in `fuzz/mod.rs`):
//! fixed seeds, a bounded number of cases per format in CI, more on demand.
//!
//! ```text
//! cargo test --release --test fuzz_load                      # CI: 1,000 cases per format
//! KILN_FUZZ_CASES=100000 cargo test --release --test fuzz_load -- --nocapture --test-threads 1
//! KILN_FUZZ_SEED=7 ...                                       # another fixed stream of cases
//! ```
//!
//! Every case must end in a typed error or a loaded model; a panic fails the test, and its input
//! is saved under `target/fuzz-failures/FORMAT-SEED-CASE/`. Each case runs under a watchdog
//! (`KILN_FUZZ_HANG_SECS`, default 5): a case that runs longer is saved the same way and ends the
//! process. Allocations are capped (`CAP`) by the global allocator below, so one sized from file
//! content without a check aborts the run instead of passing on a machine with memory to spare;
//! the case being run is still on disk under the case directory printed at the start.

mod fuzz;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use fuzz::{Format, Outcome, Rng, Seeds};

/// Largest single allocation a case may make: the fixtures are under a megabyte, so anything
/// near this was sized from a number in the file rather than from its bytes.
const CAP: usize = 512 << 20;

struct Capped;

// SAFETY: forwards to the system allocator; refusing (null) is the documented failure.
unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > CAP {
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > CAP {
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > CAP {
            return std::ptr::null_mut();
        }
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOC: Capped = Capped;

const DEFAULT_CASES: usize = 1000;

/// Where cases are written: `KILN_FUZZ_DIR`, else memory-backed `/dev/shm` where there is one
/// (each case writes a directory, and a disk makes that the slowest part of a case), else the
/// temporary directory.
fn case_root() -> PathBuf {
    match std::env::var_os("KILN_FUZZ_DIR") {
        Some(d) => PathBuf::from(d),
        None if Path::new("/dev/shm").is_dir() => PathBuf::from("/dev/shm"),
        None => std::env::temp_dir(),
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

thread_local! {
    /// The last panic on this thread, with its location (set by the hook below).
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
    /// Whether this thread is running a case.
    static IN_CASE: RefCell<bool> = const { RefCell::new(false) };
}

/// A panic during a case is recorded rather than printed (`kiln` catches some from its
/// dependencies, and an escaped one is reported with its input); others print as usual.
fn quiet_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if IN_CASE.with(|c| *c.borrow()) {
                LAST_PANIC.with(|l| *l.borrow_mut() = Some(info.to_string()));
            } else {
                default(info);
            }
        }))
    });
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::create_dir_all(to);
    if let Ok(entries) = std::fs::read_dir(from) {
        for e in entries.flatten() {
            let _ = std::fs::copy(e.path(), to.join(e.file_name()));
        }
    }
}

fn failures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fuzz-failures")
}

/// The case now running, for the watchdog.
type Current = Arc<Mutex<Option<(Instant, usize)>>>;

fn watchdog(format: Format, seed: u64, dir: PathBuf, current: Current, limit: Duration) {
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(200));
        let running = *current.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((started, case)) = running {
            if started.elapsed() > limit {
                let saved = failures_dir().join(format!("{}-{seed}-{case}-hang", format.name()));
                copy_dir(&dir, &saved);
                eprintln!(
                    "fuzz {}: case {case} (seed {seed}) ran over {limit:?}; input saved to {}",
                    format.name(),
                    saved.display()
                );
                std::process::exit(1);
            }
        }
    });
}

/// Runs `KILN_FUZZ_CASES` cases of `format` and fails on the first panic.
fn fuzz(format: Format) {
    quiet_panics();
    let cases = env_usize("KILN_FUZZ_CASES", DEFAULT_CASES);
    let seed = env_usize("KILN_FUZZ_SEED", 1) as u64;
    let limit = Duration::from_secs(env_usize("KILN_FUZZ_HANG_SECS", 5) as u64);
    let seeds = Seeds::load();
    let dir = case_root().join(format!(
        "kiln-fuzz-{}-{}-{seed}",
        std::process::id(),
        format.name()
    ));
    eprintln!("fuzz {}: cases run in {}", format.name(), dir.display());
    let current: Current = Arc::new(Mutex::new(None));
    watchdog(format, seed, dir.clone(), Arc::clone(&current), limit);

    let started = Instant::now();
    let (mut refused, mut loaded, mut caught_inside) = (0usize, 0usize, 0usize);
    let mut first_caught = None;
    for case in 0..cases {
        // One stream per (format, seed, case): a failure replays from these three numbers.
        let mut rng = Rng::new(
            seed.wrapping_mul(0x9e37_79b9)
                ^ (case as u64).wrapping_mul(0x85eb_ca6b)
                ^ (format as u64) << 56,
        );
        LAST_PANIC.with(|l| l.borrow_mut().take());
        *current.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), case));
        IN_CASE.with(|c| *c.borrow_mut() = true);
        let result = fuzz::run_one(format, &seeds, &mut rng, &dir);
        IN_CASE.with(|c| *c.borrow_mut() = false);
        *current.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let last = LAST_PANIC.with(|l| l.borrow_mut().take());
        match result {
            Ok(Outcome::Refused) => refused += 1,
            Ok(Outcome::Loaded) => loaded += 1,
            Err(msg) => {
                let saved = failures_dir().join(format!("{}-{seed}-{case}", format.name()));
                copy_dir(&dir, &saved);
                panic!(
                    "fuzz {}: case {case} (seed {seed}) panicked: {}\ninput saved to {}",
                    format.name(),
                    last.unwrap_or(msg),
                    saved.display()
                );
            }
        }
        if (case + 1) % 10_000 == 0 {
            let secs = started.elapsed().as_secs_f64();
            eprintln!(
                "fuzz {}: {} cases in {secs:.0} s ({:.0}/s), none escaped so far",
                format.name(),
                case + 1,
                (case + 1) as f64 / secs.max(1e-9)
            );
        }
        // A panic kiln caught from a dependency and turned into an error: allowed, counted.
        if let Some(msg) = last {
            caught_inside += 1;
            first_caught.get_or_insert(format!("case {case}: {msg}"));
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "fuzz {}: {cases} cases in {secs:.1} s ({:.0}/s): {refused} refused, {loaded} loaded, \
         {caught_inside} dependency panics caught by kiln, 0 escaped",
        format.name(),
        cases as f64 / secs.max(1e-9)
    );
    if let Some(msg) = first_caught {
        eprintln!(
            "fuzz {}: first dependency panic caught: {msg}",
            format.name()
        );
    }
    // The mutations must leave some inputs loadable, or the deeper stages go untested.
    if cases >= 100 {
        assert!(loaded > 0, "fuzz {}: no case loaded", format.name());
        assert!(refused > 0, "fuzz {}: no case was refused", format.name());
    }
}

#[test]
fn fuzz_gguf() {
    fuzz(Format::Gguf);
}

#[test]
fn fuzz_safetensors() {
    fuzz(Format::Safetensors);
}

#[test]
fn fuzz_config_json() {
    fuzz(Format::Config);
}

#[test]
fn fuzz_tokenizer_json() {
    fuzz(Format::Tokenizer);
}

#[test]
fn fuzz_chat_template() {
    fuzz(Format::ChatTemplate);
}

/// Replays a saved case: `KILN_FUZZ_REPLAY=target/fuzz-failures/DIR KILN_FUZZ_FORMAT=config
/// cargo test --release --test fuzz_load replay -- --nocapture` (a GGUF case is its
/// `model.gguf`; the format only decides which checks run after a load).
#[test]
fn replay() {
    let Some(dir) = std::env::var_os("KILN_FUZZ_REPLAY").map(PathBuf::from) else {
        return;
    };
    let format = std::env::var("KILN_FUZZ_FORMAT").unwrap_or_default();
    let format = Format::ALL
        .into_iter()
        .find(|f| f.name() == format)
        .unwrap_or(Format::Config);
    let gguf = dir.join("model.gguf");
    let path = if gguf.exists() { gguf } else { dir };
    let started = Instant::now();
    let outcome = fuzz::exercise(&path, format);
    eprintln!(
        "replay {}: {outcome:?} in {:?}",
        path.display(),
        started.elapsed()
    );
}

/// The mutators are deterministic: the same seed gives the same bytes.
#[test]
fn cases_replay_from_their_seed() {
    let seeds = Seeds::load();
    for format in Format::ALL {
        let a = fuzz::generate(format, &seeds, &mut Rng::new(42)).files;
        let b = fuzz::generate(format, &seeds, &mut Rng::new(42)).files;
        assert!(a == b, "{format:?}");
    }
}
