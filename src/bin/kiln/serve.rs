//! `kiln serve`: the OpenAI-compatible HTTP server (`kiln::server`) over one model.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;

use kiln::backend::cpu::CpuOptions;
use kiln::engine::{Engine, EngineHandle, EngineOptions, ServeOptions};
use kiln::kv::KvBudget;
use kiln::server::{router, ServerConfig};

#[derive(Parser, Debug)]
#[command(
    name = "kiln serve",
    version,
    about = "Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)"
)]
pub struct ServeArgs {
    /// Model: a Hugging Face directory or a .gguf file.
    #[arg(short, long)]
    model: PathBuf,
    /// Address to listen on (127.0.0.1 keeps the server off the network).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Context per request, prompt and completion together (0 = the model's).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
    ctx_size: usize,
    /// Memory for the KV cache pool shared by all requests: bytes, or with a K/M/G suffix.
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    kv_budget: usize,
    /// Requests generating at once (each of n choices counts).
    #[arg(long, default_value_t = 64)]
    max_running: usize,
    /// Requests that may wait for a place; more get 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Tokens one engine step may run (prompts are prefilled in chunks of this size).
    #[arg(long, default_value_t = 256)]
    max_step_tokens: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long)]
    api_key: Option<String>,
    /// The model name clients send (default: the model file or directory name).
    #[arg(long)]
    model_name: Option<String>,
    /// Largest request body accepted, bytes or with a K/M/G suffix.
    #[arg(long, default_value = "4M", value_parser = parse_size)]
    max_body: usize,
    /// Seconds a client may take to send a request's head, and then its body (slower ones are
    /// disconnected, or answered 408).
    #[arg(long, default_value_t = 30.0, value_parser = parse_seconds)]
    read_timeout: f64,
    /// Do not reuse cached prompt prefixes across requests.
    #[arg(long)]
    no_prefix_cache: bool,
    /// CPU threads (0 = all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
}

/// A positive, finite number of seconds.
fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds in (0, 86400]")),
    }
}

/// `512M`, `2G`, `65536`: a size in bytes.
fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                _ => return Err(format!("{s:?}: the suffix must be K, M or G")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: usize = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a size (bytes, or a number with K, M or G)"))?;
    n.checked_mul(1usize << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

fn model_name(path: &Path) -> String {
    let name = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    name.map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned())
}

/// `--host` (an IPv4 or IPv6 address, or `localhost`) and `--port` as a socket address.
fn listen_addr(host: &str, port: u16) -> Result<SocketAddr> {
    let ip: IpAddr = match host {
        "localhost" => IpAddr::from([127, 0, 0, 1]),
        h => h
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .with_context(|| format!("--host {h:?} is not an IP address"))?,
    };
    Ok(SocketAddr::new(ip, port))
}

pub fn run(args: ServeArgs) -> Result<()> {
    for (flag, v) in [
        ("--max-running", args.max_running),
        ("--max-step-tokens", args.max_step_tokens),
    ] {
        if v == 0 {
            bail!("{flag} must be at least 1");
        }
    }
    let addr = listen_addr(&args.host, args.port)?;
    let t0 = Instant::now();
    let opts = EngineOptions {
        device: kiln::engine::Device::Cpu,
        cpu: CpuOptions {
            threads: args.threads,
            ..CpuOptions::default()
        },
        ..EngineOptions::default()
    };
    let engine = Engine::load(&args.model, opts).context("loading the model")?;
    let model_ctx = engine.max_context();
    let context = match args.ctx_size {
        0 => model_ctx,
        c if c > model_ctx => {
            bail!("-c {c} is more than the model's context ({model_ctx})")
        }
        c => c,
    };
    eprintln!(
        "kiln: {} loaded in {:.2} s, on {}",
        args.model.display(),
        t0.elapsed().as_secs_f64(),
        engine.device()
    );
    let engine = Arc::new(engine);
    let serve_opts = ServeOptions {
        kv_budget: KvBudget::Bytes(args.kv_budget),
        max_running: args.max_running,
        max_step_tokens: args.max_step_tokens,
        prefix_cache: !args.no_prefix_cache,
        ..ServeOptions::default()
    };
    let handle = EngineHandle::start(engine, serve_opts).context("starting the scheduler")?;
    let config = ServerConfig {
        model_id: args.model_name.unwrap_or_else(|| model_name(&args.model)),
        context,
        max_running: args.max_running,
        max_queue: args.max_queue,
        api_key: args.api_key,
        max_body_bytes: args.max_body,
        read_timeout: std::time::Duration::from_secs_f64(args.read_timeout),
    };
    let model_id = config.model_id.clone();
    let read_timeout = config.read_timeout;
    let app = router(handle, config);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        let local = listener.local_addr().context("reading the bound address")?;
        eprintln!("kiln: serving {model_id:?} on http://{local}/v1 (Ctrl-C to stop)");
        kiln::server::serve(listener, app, read_timeout, shutdown_signal())
            .await
            .context("serving")
    })?;
    eprintln!("kiln: stopped");
    Ok(())
}

/// Ctrl-C or SIGTERM: stop accepting connections; requests in flight finish.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    eprintln!("kiln: shutting down; finishing the requests in flight");
}

#[cfg(test)]
mod tests {
    use super::{listen_addr, parse_size};

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("65536"), Ok(65536));
        assert!(parse_size("12X").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }

    #[test]
    fn hosts() {
        assert_eq!(
            listen_addr("127.0.0.1", 80).unwrap().to_string(),
            "127.0.0.1:80"
        );
        assert_eq!(listen_addr("::1", 80).unwrap().to_string(), "[::1]:80");
        assert_eq!(listen_addr("[::1]", 80).unwrap().to_string(), "[::1]:80");
        assert_eq!(
            listen_addr("localhost", 80).unwrap().to_string(),
            "127.0.0.1:80"
        );
        assert!(listen_addr("0.0.0.0.1", 80).is_err());
    }
}
