//! The handle services use: one scheduler on its own thread, shared by any number of threads.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use kiln::engine::{Engine, EngineHandle, Event, GenerateOptions, Request, ServeOptions};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = Arc::new(Engine::load("model.gguf", kiln::backend::cpu::CpuOptions::default())?);
//! let handle = EngineHandle::start(Arc::clone(&engine), ServeOptions::default())?;
//! let prompt = engine.tokenizer().encode("The capital of France is")?;
//! let req = handle.submit(Request { prompt, options: GenerateOptions::default(), spec: None })?;
//! for event in req {
//!     match event {
//!         Event::Step(step) => print!("{}", step.rows[0].as_ref().map_or("", |r| &r.text)),
//!         Event::Done(done) => println!("\n{:?}", done.usage),
//!         Event::Error(e) => eprintln!("{e}"),
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! Submitting validates the request at once (an error comes back from `submit`); its events
//! then arrive as the scheduler produces them. Dropping a [`RequestHandle`] (or calling
//! [`RequestHandle::cancel`]) cancels the request and frees its blocks at the next step; a
//! callback that returns `false` does the same.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread;

use super::collect::RowsCollector;
use super::scheduler::{Event, Request, Scheduler, SchedulerStats, ServeOptions, Sink};
use super::sequence::RequestId;
use super::{BatchResult, Engine, EngineError, Timings, Usage};

enum Command {
    Submit {
        id: RequestId,
        req: Box<Request>,
        sink: Sink,
        accepted: Sender<Result<(), EngineError>>,
    },
    Cancel(RequestId),
}

/// A running scheduler (cheap to clone; every clone talks to the same one). The scheduler
/// thread ends when every handle and request handle is gone and its work is done.
#[derive(Clone)]
pub struct EngineHandle {
    engine: Arc<Engine>,
    tx: Sender<Command>,
    next_id: Arc<AtomicU64>,
    stats: Arc<Mutex<SchedulerStats>>,
}

impl EngineHandle {
    /// Starts the scheduler thread over `engine`. On a CUDA engine its steps run kernel by
    /// kernel over a device pool, decode phases through its megakernel graph (on an H200 the
    /// scheduler's GPU test passed, docs/gpu-results.md run 10).
    pub fn start(engine: Arc<Engine>, opts: ServeOptions) -> Result<EngineHandle, EngineError> {
        let mut sched = Scheduler::new(Arc::clone(&engine), opts)?;
        let (tx, rx) = mpsc::channel::<Command>();
        let stats = Arc::new(Mutex::new(sched.stats()));
        let shared = Arc::clone(&stats);
        thread::Builder::new()
            .name("kiln-scheduler".into())
            .spawn(move || run(&mut sched, &rx, &shared))
            .map_err(|e| {
                EngineError::Backend(crate::backend::cpu::BackendError::Threads {
                    threads: 1,
                    reason: e.to_string(),
                })
            })?;
        Ok(EngineHandle {
            engine,
            tx,
            next_id: Arc::new(AtomicU64::new(1)),
            stats,
        })
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    fn send(&self, id: RequestId, req: Request, sink: Sink) -> Result<(), EngineError> {
        let (accepted, ok) = mpsc::channel();
        self.tx
            .send(Command::Submit {
                id,
                req: Box::new(req),
                sink,
                accepted,
            })
            .map_err(|_| EngineError::Stopped)?;
        ok.recv().map_err(|_| EngineError::Stopped)?
    }

    /// Queues a request; its events come through the returned handle.
    pub fn submit(&self, req: Request) -> Result<RequestHandle, EngineError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (etx, erx) = mpsc::channel();
        let prompt = req.prompt.clone();
        let rows = req.options.num_samples;
        let stop = req
            .options
            .stop_tokens
            .clone()
            .unwrap_or_else(|| self.engine.default_stop_tokens());
        self.send(id, req, Box::new(move |e| etx.send(e).is_ok()))?;
        Ok(RequestHandle {
            id,
            rx: erx,
            tx: self.tx.clone(),
            prompt,
            rows,
            stop,
            done: false,
        })
    }

    /// Queues a request whose events go to `callback` on the scheduler thread (keep it short;
    /// return `false` to cancel).
    pub fn submit_with(
        &self,
        req: Request,
        callback: impl FnMut(Event) -> bool + Send + 'static,
    ) -> Result<RequestId, EngineError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.send(id, req, Box::new(callback))?;
        Ok(id)
    }

    /// Cancels a request (a no-op once it has finished).
    pub fn cancel(&self, id: RequestId) {
        let _ = self.tx.send(Command::Cancel(id));
    }

    /// Queue, memory and cache counters as of the last step.
    pub fn stats(&self) -> SchedulerStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The scheduler thread: takes commands, steps while there is work, sleeps when there is none.
fn run(sched: &mut Scheduler, rx: &Receiver<Command>, stats: &Mutex<SchedulerStats>) {
    let mut open = true;
    loop {
        if sched.is_idle() {
            if !open {
                return;
            }
            match rx.recv() {
                Ok(cmd) => apply(sched, cmd),
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => apply(sched, cmd),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if let Err(e) = sched.step() {
            sched.fail_all(&e.to_string());
        }
        *stats.lock().unwrap_or_else(|e| e.into_inner()) = sched.stats();
    }
}

fn apply(sched: &mut Scheduler, cmd: Command) {
    match cmd {
        Command::Submit {
            id,
            req,
            sink,
            accepted,
        } => {
            let _ = accepted.send(sched.submit(id, *req, sink));
        }
        Command::Cancel(id) => sched.cancel(id),
    }
}

/// A submitted request: an iterator over its [`Event`]s, ending after `Done` or `Error`.
/// Dropping it cancels the request if it is still running.
pub struct RequestHandle {
    id: RequestId,
    rx: Receiver<Event>,
    tx: Sender<Command>,
    prompt: Vec<u32>,
    rows: usize,
    stop: Vec<u32>,
    done: bool,
}

impl RequestHandle {
    pub fn id(&self) -> RequestId {
        self.id
    }

    pub fn cancel(&self) {
        let _ = self.tx.send(Command::Cancel(self.id));
    }

    /// Runs to the end and gathers the rows (like [`Engine::generate_batch`]; timings are not
    /// measured per request).
    pub fn wait(mut self) -> Result<BatchResult, EngineError> {
        let mut rows = RowsCollector::new(self.rows);
        let mut usage = Usage::default();
        for event in self.by_ref() {
            match event {
                Event::Step(step) => rows.push(&step),
                Event::Done(done) => {
                    usage = done.usage;
                    for (r, reason) in done.finish_reasons.into_iter().enumerate() {
                        rows.set_reason(r, reason);
                    }
                }
                Event::Error(e) => return Err(EngineError::Request(e)),
            }
        }
        Ok(BatchResult {
            rows: rows.finish(&self.prompt, &self.stop),
            usage,
            timings: Timings::default(),
        })
    }
}

impl Iterator for RequestHandle {
    type Item = Event;

    fn next(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        match self.rx.recv() {
            Ok(e) => {
                self.done = matches!(e, Event::Done(_) | Event::Error(_));
                Some(e)
            }
            Err(_) => {
                self.done = true;
                None
            }
        }
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        if !self.done {
            self.cancel();
        }
    }
}
