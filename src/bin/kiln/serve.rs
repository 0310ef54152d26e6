//! `kiln serve`: the OpenAI-compatible HTTP server (`kiln::server`) over one model. Its flags
//! are parsed and checked in the library (`kiln::cli::serve_args`).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use kiln::backend::cpu::CpuOptions;
use kiln::cli::serve_args::ServeCommand;
use kiln::engine::{Engine, EngineHandle, EngineOptions, ServeOptions};
use kiln::kv::KvBudget;
use kiln::server::{router, ServerConfig};

fn model_name(path: &Path) -> String {
    let name = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    name.map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned())
}

pub fn run(cmd: ServeCommand) -> Result<()> {
    let ServeCommand { args, addr } = cmd;
    let t0 = Instant::now();
    let opts = EngineOptions {
        device: kiln::engine::Device::Cpu,
        cpu: CpuOptions {
            threads: args.threads,
            numerics: args.numerics.numerics(),
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
    let draft = match args.spec.draft_path() {
        Some(path) => Some(Arc::new(
            Engine::load(path, opts).with_context(|| format!("--draft {}", path.display()))?,
        )),
        None => None,
    };
    let spec = args.spec.options(&engine, draft)?;
    if let Some(s) = &spec {
        eprintln!(
            "kiln: speculative decoding: {:?}, up to {} proposed tokens per pass",
            s.method, s.max_draft
        );
    }
    let engine = Arc::new(engine);
    let serve_opts = ServeOptions {
        kv_budget: KvBudget::Bytes(args.kv_budget),
        max_running: args.max_running,
        max_step_tokens: args.max_step_tokens,
        prefix_cache: !args.no_prefix_cache,
        spec_step_rows: args.spec_step_rows.unwrap_or(usize::MAX),
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
        spec,
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
