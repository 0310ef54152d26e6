//! `kiln-bench serve-load`: the serving benchmark's client side ([`kiln::bench::load`]) on the
//! command line. One table row per concurrency level; the server is started (and pinned to its
//! CPUs) by whoever runs this, e.g. `scripts/serve_compare.sh`.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use kiln::bench::load::{self, http::Url, stats, workload::Workload, LoadConfig};
use kiln::cli::output::Stdout;
use kiln::note;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LoadOutput {
    /// A Markdown table.
    Md,
    /// An array of objects, one per level.
    Json,
}

#[derive(Args, Debug)]
pub struct ServeLoadArgs {
    /// The server's base URL (plain HTTP); requests go to URL/v1/completions.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Concurrent closed-loop clients, one level per value (comma list).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    concurrency: Vec<usize>,
    /// Completion tokens per request (sent as max_tokens with ignore_eos).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Requests each client sends per level.
    #[arg(long, default_value_t = 4)]
    requests_per_client: usize,
    /// The fewest requests a level sends, whatever its concurrency.
    #[arg(long, default_value_t = 16)]
    min_requests: usize,
    /// Untimed requests sent one at a time before the first level.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Seed of the prompt set (the same seed gives every server the same requests).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// The server column of the table.
    #[arg(long, default_value = "server")]
    label: String,
    /// Seconds the connect and each read of a request may take.
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
    #[arg(short = 'o', long, value_enum, default_value_t = LoadOutput::Md)]
    output: LoadOutput,
}

/// The most clients one level may run (a thread each).
const MAX_CONCURRENCY: usize = 1024;
/// The most requests one level may send.
const MAX_REQUESTS: usize = 1 << 20;

pub fn run(args: &ServeLoadArgs) -> Result<()> {
    let url = Url::parse(&args.url)?;
    if args.concurrency.is_empty() {
        bail!("--concurrency needs at least one value");
    }
    if let Some(&c) = args
        .concurrency
        .iter()
        .find(|&&c| c == 0 || c > MAX_CONCURRENCY)
    {
        bail!("--concurrency {c}: each value must be between 1 and {MAX_CONCURRENCY}");
    }
    if args.max_tokens == 0 || args.max_tokens > u32::MAX as usize {
        bail!(
            "--max-tokens {}: must be between 1 and {}",
            args.max_tokens,
            u32::MAX
        );
    }
    if args.requests_per_client == 0 {
        bail!("--requests-per-client must be at least 1");
    }
    if args.timeout_s == 0 {
        bail!("--timeout-s must be at least 1");
    }
    let cfg = LoadConfig {
        url,
        label: args.label.clone(),
        workload: Workload {
            seed: args.seed,
            max_tokens: args.max_tokens,
        },
        timeout: Duration::from_secs(args.timeout_s),
    };
    for i in 0..args.warmup {
        // Numbered past any level's requests, so warm-up prompts are not the timed ones.
        load::one_request(&cfg, usize::MAX - i).with_context(|| {
            format!(
                "warm-up request {} to {}{}",
                i + 1,
                args.url,
                load::COMPLETIONS
            )
        })?;
    }
    let mut rows = Vec::new();
    for &c in &args.concurrency {
        let n = load::level_requests(c, args.requests_per_client, args.min_requests);
        if n > MAX_REQUESTS {
            bail!("{n} requests at {c} clients: at most {MAX_REQUESTS} per level");
        }
        note!(
            "serve-load: {}: {c} clients, {n} requests of {} tokens",
            args.label,
            args.max_tokens
        );
        let row =
            load::run_level(&cfg, c, n).with_context(|| format!("{} at {c} clients", args.url))?;
        note!(
            "serve-load: {}: {c} clients: {:.1} tok/s, {} errors, {} short",
            args.label,
            row.tokens_per_s,
            row.errors,
            row.short
        );
        rows.push(row);
    }
    let text = match args.output {
        LoadOutput::Md => stats::markdown(&rows),
        LoadOutput::Json => serde_json::to_string_pretty(&rows)? + "\n",
    };
    let mut out = Stdout::lock();
    out.write(&text)?;
    out.flush()?;
    Ok(())
}
