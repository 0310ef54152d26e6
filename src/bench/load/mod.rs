//! A closed-loop load generator for OpenAI-compatible completion servers (`kiln serve`,
//! llama.cpp's `llama-server`, vLLM): `c` clients each send a streaming request, read it to
//! the end, and send the next, until the level's requests are done. Every client is a blocking
//! thread over its own connection ([`http`]), so waiting costs no CPU the server could use.
//! Measured per level ([`stats`]): aggregate completion tokens/s and requests/s over the wall
//! time, time to first token and inter-token latency (p50/p99).
//!
//! The workload ([`workload`]) is identical for every server: a seeded set of prompts of mixed
//! lengths, greedy, exactly `max_tokens` tokens each (`ignore_eos`); a completion of another
//! length is counted in the `short` column rather than hidden.

pub mod http;
pub mod sse;
pub mod stats;
pub mod workload;

use std::io::{BufReader, Read};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sse::{clip, Events, RequestRecord, Tally};
use stats::LevelStats;
use workload::Workload;

/// Why a request or a run of the load generator failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("--url {url}: {why}")]
    Url { url: String, why: String },
    #[error("{url}: {source}")]
    Io {
        url: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the server answered {}: {message}", status.map_or_else(|| "an error event".to_string(), |s| format!("HTTP {s}")))]
    Server {
        status: Option<u16>,
        message: String,
    },
    #[error("the server's stream is malformed: {why}")]
    Protocol { why: String },
    #[error(
        "every one of the {requests} requests at {concurrency} clients failed; the first: {first}"
    )]
    AllFailed {
        concurrency: usize,
        requests: usize,
        first: Box<LoadError>,
    },
}

/// The completions route every supported server has.
pub const COMPLETIONS: &str = "/v1/completions";

/// What one run of the load generator sends and where.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    pub url: http::Url,
    /// The table's server column.
    pub label: String,
    pub workload: Workload,
    /// Bounds the connect and each read and write of a request.
    pub timeout: Duration,
}

/// Sends request `i` and reads its stream to the end.
pub fn one_request(cfg: &LoadConfig, i: usize) -> Result<RequestRecord, LoadError> {
    let body = cfg.workload.body(i);
    let t0 = Instant::now();
    let resp = http::post_json(&cfg.url, COMPLETIONS, &body, cfg.timeout)?;
    let io = |e: std::io::Error| LoadError::Io {
        url: format!("{}:{}{}", cfg.url.host, cfg.url.port, COMPLETIONS),
        source: e,
    };
    if resp.status != 200 {
        let mut text = String::new();
        let _ = resp.body.take(64 << 10).read_to_string(&mut text);
        return Err(LoadError::Server {
            status: Some(resp.status),
            message: clip(text.trim()),
        });
    }
    let mut events = Events::new(BufReader::new(resp.body));
    let mut tally = Tally::default();
    while let Some(data) = events.next_data().map_err(io)? {
        if tally.on_data(&data, t0.elapsed())? {
            break;
        }
    }
    tally.finish(t0.elapsed())
}

/// The number of requests a level of `concurrency` clients sends: `per_client` each, and at least
/// `min_requests` in all.
pub fn level_requests(concurrency: usize, per_client: usize, min_requests: usize) -> usize {
    concurrency.saturating_mul(per_client).max(min_requests)
}

/// Runs one closed-loop level: `concurrency` clients share `requests` requests (numbered from
/// 0, so every server gets the same ones), each client sending its next as soon as its last
/// one ends.
pub fn run_level(
    cfg: &LoadConfig,
    concurrency: usize,
    requests: usize,
) -> Result<LevelStats, LoadError> {
    let next = AtomicUsize::new(0);
    let records = Mutex::new(Vec::with_capacity(requests));
    let failures: Mutex<Vec<LoadError>> = Mutex::new(Vec::new());
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..concurrency.min(requests) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests {
                    break;
                }
                match one_request(cfg, i) {
                    Ok(r) => records.lock().unwrap_or_else(|p| p.into_inner()).push(r),
                    Err(e) => failures.lock().unwrap_or_else(|p| p.into_inner()).push(e),
                }
            });
        }
    });
    let wall = t0.elapsed();
    let records = records.into_inner().unwrap_or_else(|p| p.into_inner());
    let failures = failures.into_inner().unwrap_or_else(|p| p.into_inner());
    if records.is_empty() {
        if let Some(first) = failures.into_iter().next() {
            return Err(LoadError::AllFailed {
                concurrency,
                requests,
                first: Box::new(first),
            });
        }
        return Ok(LevelStats::new(
            &cfg.label,
            concurrency,
            cfg.workload.max_tokens,
            &[],
            0,
            wall,
        ));
    }
    if let Some(first) = failures.first() {
        crate::note!(
            "serve-load: {} of {requests} requests failed at {concurrency} clients; the first: {first}",
            failures.len()
        );
    }
    Ok(LevelStats::new(
        &cfg.label,
        concurrency,
        cfg.workload.max_tokens,
        &records,
        failures.len(),
        wall,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_per_level() {
        assert_eq!(level_requests(1, 4, 16), 16);
        assert_eq!(level_requests(16, 4, 16), 64);
        assert_eq!(level_requests(usize::MAX, 4, 1), usize::MAX);
    }
}
