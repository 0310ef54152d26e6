//! Aggregate decode throughput of the scheduler: `c` sequences generating together over one
//! shared KV pool, each step reading the weights once for all of them.
//!
//! Every sequence gets its own random prompt (no prefix sharing), or the [`Load`]'s prompt,
//! decodes greedily for exactly `n_gen` tokens (stop tokens off), speculatively when the load
//! says so, and the clock for decode starts once every sequence has its first token (all
//! prompts prefilled).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::token_ids;
use crate::engine::{
    Engine, EngineError, Event, GenerateOptions, Request, Scheduler, ServeOptions, SpecOptions,
};
use crate::kv::KvBudget;

#[derive(Clone, Debug, Serialize)]
pub struct ServingRow {
    pub concurrency: usize,
    pub prompt: usize,
    pub n_gen: usize,
    /// Wall time from submission to the last token.
    pub total_s: f64,
    /// Tokens generated after every sequence has its first, per second over all sequences.
    pub decode_tokens_per_s: f64,
    /// Scheduler steps taken in the decode phase.
    pub decode_steps: u64,
    /// KV bytes one sequence holds at its longest (whole blocks).
    pub kv_bytes_per_seq: usize,
    /// Accepted over proposed tokens, with speculation.
    pub acceptance_rate: Option<f64>,
    /// Steps of the whole run, those that consumed a decode-graph replay, and those whose
    /// tokens were drawn on the device (GPU engines; both 0 on the CPU).
    pub steps: u64,
    pub graph_steps: u64,
    pub device_draw_steps: u64,
}

/// What every sequence of a run does beyond the defaults.
#[derive(Clone, Debug, Default)]
pub struct Load {
    /// The prompt every sequence gets (instead of a random one of the run's length each).
    pub prompt: Option<Vec<u32>>,
    /// Speculative decoding for every sequence.
    pub spec: Option<SpecOptions>,
}

/// Runs `concurrency` sequences of `prompt` + `n_gen` tokens through one scheduler.
pub fn run(
    engine: &Arc<Engine>,
    opts: ServeOptions,
    concurrency: usize,
    prompt: usize,
    n_gen: usize,
    seed: u64,
    load: &Load,
) -> Result<ServingRow, EngineError> {
    let prompt = load.prompt.as_ref().map_or(prompt, Vec::len);
    // Proposals of the last pass may run a few positions past the last token.
    let slack = load.spec.as_ref().map_or(0, |s| s.max_draft);
    let per_seq = prompt.saturating_add(n_gen).saturating_add(slack);
    let mut opts = opts;
    let mut sched = Scheduler::new(Arc::clone(engine), opts)?;
    let layout = *sched.cache().layout();
    let blocks = layout.blocks_for(per_seq).saturating_mul(concurrency);
    opts.kv_budget = KvBudget::Blocks(blocks.max(1));
    opts.max_running = concurrency.max(1);
    sched = Scheduler::new(Arc::clone(engine), opts)?;
    let vocab = engine.config().vocab_size;
    let firsts = Arc::new(std::sync::Mutex::new(HashMap::new()));
    let t0 = Instant::now();
    for c in 0..concurrency {
        let firsts = Arc::clone(&firsts);
        sched.submit(
            c as u64,
            Request {
                prompt: match &load.prompt {
                    Some(p) => p.clone(),
                    None => token_ids(prompt.max(1), vocab, seed.wrapping_add(c as u64)),
                },
                options: GenerateOptions {
                    max_tokens: Some(n_gen.max(1)),
                    stop_tokens: Some(Vec::new()),
                    tools: false,
                    ..GenerateOptions::default()
                },
                spec: load.spec.clone(),
            },
            Box::new(move |e| {
                if let Event::Step(_) = e {
                    let mut f = firsts.lock().unwrap_or_else(|p| p.into_inner());
                    f.entry(c).or_insert_with(Instant::now);
                }
                true
            }),
        )?;
    }
    let mut decode_start = None;
    let mut steps_at_start = 0;
    let mut generated_at_start = 0;
    while !sched.is_idle() {
        sched.step()?;
        if decode_start.is_none()
            && firsts.lock().unwrap_or_else(|p| p.into_inner()).len() == concurrency
        {
            decode_start = Some(Instant::now());
            steps_at_start = sched.stats().steps;
            generated_at_start = sched.stats().generated_tokens;
        }
    }
    let end = Instant::now();
    let start = decode_start.unwrap_or(end);
    // Tokens generated while the clock ran: sequences whose prompts were in early have
    // already decoded some by then (more of them the smaller the step budget).
    let decode_tokens = (sched.stats().generated_tokens - generated_at_start) as usize;
    let secs = (end - start).as_secs_f64();
    Ok(ServingRow {
        concurrency,
        prompt,
        n_gen,
        total_s: (end - t0).as_secs_f64(),
        decode_tokens_per_s: if secs > 0.0 {
            decode_tokens as f64 / secs
        } else {
            0.0
        },
        decode_steps: sched.stats().steps - steps_at_start,
        kv_bytes_per_seq: layout.blocks_for(per_seq) * layout.bytes_per_block(),
        acceptance_rate: load.spec.as_ref().map(|_| {
            let s = sched.stats();
            s.spec_accepted_tokens as f64 / s.spec_proposed_tokens.max(1) as f64
        }),
        steps: sched.stats().steps,
        graph_steps: sched.stats().graph_steps,
        device_draw_steps: sched.stats().device_draw_steps,
    })
}
