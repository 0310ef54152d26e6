//! `KILN_TRACE_CUDA=1`: how long each phase of loading a model onto the device and of a
//! session's decode graph takes, on stderr. Why: on an H100 and an H200 a Llama-3.2-1B
//! megakernel process spent seconds outside its timed decode (docs/gpu-results.md, runs 9
//! and 10), and nothing said where; a phase that grows with the model shows here first.

use std::sync::OnceLock;
use std::time::Instant;

/// Whether `KILN_TRACE_CUDA=1` is set (read once).
pub fn enabled() -> bool {
    static TRACE: OnceLock<bool> = OnceLock::new();
    *TRACE.get_or_init(|| std::env::var("KILN_TRACE_CUDA").is_ok_and(|v| v.trim() == "1"))
}

/// Runs `f`, and when [`enabled`] prints how long it took as `kiln: cuda WHAT: N ms`.
pub fn traced<T>(what: impl FnOnce() -> String, f: impl FnOnce() -> T) -> T {
    let phase = Phase::start();
    let out = f();
    phase.end(what);
    out
}

/// A phase timed by hand where a closure would not fit (a loop that returns early on errors):
/// [`Phase::start`], then [`Phase::end`] prints `kiln: cuda WHAT: N ms` when [`enabled`].
pub struct Phase(Option<Instant>);

impl Phase {
    pub fn start() -> Phase {
        Phase(enabled().then(Instant::now))
    }

    pub fn end(self, what: impl FnOnce() -> String) {
        if let Some(t0) = self.0 {
            eprintln!(
                "kiln: cuda {}: {:.3} ms",
                what(),
                t0.elapsed().as_secs_f64() * 1e3
            );
        }
    }
}
