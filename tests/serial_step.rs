//! A backend of one thread runs its steps on the calling thread: every parallel loop of a
//! prefill and of a decode step runs there in order, none on rayon's global pool (where a loop
//! started outside the backend's pool would go), and the logits are the same bits as on a
//! backend of two threads.
//!
//! Its own test binary: it builds rayon's global pool (one worker whose thread id it records)
//! and reads that worker's and its own CPU time from Linux's `/proc/thread-self/schedstat`.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kiln::backend::cpu::{CpuOptions, Numerics, Workspace};
use kiln::backend::TokenRow;
use kiln::engine::Engine;
use kiln::plan::PlanKind;

/// Nanoseconds the thread at `/proc/…/schedstat` `path` has run on a CPU.
fn cpu_ns(path: &Path) -> u64 {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.split_whitespace()
        .next()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{}: {text:?}", path.display()))
}

/// The calling thread's `schedstat`, by a path that stays valid from other threads
/// (`/proc/thread-self` names whichever thread reads it).
fn this_thread_schedstat() -> PathBuf {
    let task = std::fs::read_link("/proc/thread-self").expect("/proc/thread-self");
    Path::new("/proc").join(task).join("schedstat")
}

/// A 512-token prefill and 16 decode steps of one sequence; the logits of every call.
fn run(engine: &Engine) -> Vec<Vec<f32>> {
    let b = engine.cpu_backend().expect("a CPU engine");
    let vocab = b.config().vocab_size;
    let (prompt, steps) = (512, 16);
    let mut kv = b.new_cache(1, prompt + steps).unwrap();
    let mut ws = Workspace::new();
    let mut logits = Vec::new();
    let mut all = Vec::new();
    let tokens: Vec<u32> = (0..prompt)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect();
    let rows: Vec<TokenRow> = (0..prompt).map(|pos| TokenRow { slot: 0, pos }).collect();
    b.forward(
        PlanKind::Prefill,
        &mut ws,
        &mut kv,
        &tokens,
        &rows,
        &mut logits,
    )
    .unwrap();
    all.push(logits.clone());
    for pos in prompt..prompt + steps {
        let tok = [((pos * 31) % vocab) as u32];
        let row = [TokenRow { slot: 0, pos }];
        b.forward(PlanKind::Decode, &mut ws, &mut kv, &tok, &row, &mut logits)
            .unwrap();
        all.push(logits.clone());
    }
    all
}

#[test]
fn a_one_thread_backend_steps_on_the_calling_thread_alone() {
    if !cfg!(target_os = "linux") {
        println!("skipped: reads thread CPU times from Linux's /proc");
        return;
    }
    let Some(path) = common::demo_model() else {
        println!("skipped: the demo model is not fetched (scripts/fetch_demo_model.sh)");
        return;
    };
    let worker: Arc<Mutex<Option<PathBuf>>> = Arc::default();
    let record = Arc::clone(&worker);
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .start_handler(move |_| {
            *record.lock().unwrap() = Some(this_thread_schedstat());
        })
        .build_global()
        .expect("this binary's only test builds the global pool");
    // The worker has started once `build_global` returns; its handler may still be running.
    let worker = loop {
        if let Some(p) = worker.lock().unwrap().clone() {
            break p;
        }
        std::thread::yield_now();
    };
    let me = this_thread_schedstat();
    for numerics in [Numerics::default(), Numerics::Bf16] {
        let load = |threads| {
            let opts = CpuOptions {
                threads,
                numerics,
                ..CpuOptions::default()
            };
            Engine::load(&path, opts).unwrap()
        };
        let (one, two) = (load(1), load(2));
        let (worker0, me0) = (cpu_ns(&worker), cpu_ns(&me));
        let serial = run(&one);
        let (worker_ns, me_ns) = (cpu_ns(&worker) - worker0, cpu_ns(&me) - me0);
        println!(
            "{numerics:?}: this thread ran {:.1} ms, the global pool's worker {:.3} ms",
            me_ns as f64 / 1e6,
            worker_ns as f64 / 1e6
        );
        assert!(
            worker_ns * 50 < me_ns,
            "{numerics:?}: rayon's global pool ran {worker_ns} ns of a one-thread backend's \
             steps ({me_ns} ns on the calling thread): a loop escaped the step's thread"
        );
        let pooled = run(&two);
        for (i, (a, b)) in serial.iter().zip(&pooled).enumerate() {
            let same =
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{numerics:?}: call {i}'s logits differ between 1 and 2 threads"
            );
        }
    }
}
