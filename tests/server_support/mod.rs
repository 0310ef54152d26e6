//! Shared by the server's integration tests: a server on an ephemeral loopback port, a
//! minimal HTTP/1.1 client, and the library's own generation as the reference.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use kiln::backend::cpu::CpuOptions;
use kiln::engine::{Engine, EngineHandle, GenerateOptions, ServeOptions};
use kiln::kv::KvBudget;
use kiln::sample::SamplingParams;
use kiln::server::{router, ServerConfig};

pub const FIXTURE: &str = "tests/fixtures/llama_tied";
pub const MODEL: &str = "tiny";

pub struct Server {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    _rt: tokio::runtime::Runtime,
}

/// The tiny llama fixture on one thread.
pub fn tiny_engine() -> Arc<Engine> {
    Arc::new(
        Engine::load(
            FIXTURE,
            CpuOptions {
                threads: 1,
                ..CpuOptions::default()
            },
        )
        .unwrap(),
    )
}

/// A server over the tiny llama fixture with a 4 MiB KV pool, its config adjusted.
pub fn start(adjust: impl FnOnce(&mut ServerConfig)) -> Server {
    start_on(tiny_engine(), adjust)
}

/// A server over `engine` with a 4 MiB KV pool, its config adjusted.
pub fn start_on(engine: Arc<Engine>, adjust: impl FnOnce(&mut ServerConfig)) -> Server {
    let mut config = ServerConfig::new(MODEL, engine.max_context());
    config.max_body_bytes = 64 << 10;
    adjust(&mut config);
    let handle = EngineHandle::start(
        Arc::clone(&engine),
        ServeOptions {
            kv_budget: KvBudget::Bytes(4 << 20),
            max_running: config.max_running,
            ..ServeOptions::default()
        },
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let read_timeout = config.read_timeout;
    let app = router(handle, config);
    rt.spawn(kiln::server::serve(
        listener,
        app,
        read_timeout,
        std::future::pending(),
    ));
    Server {
        addr,
        engine,
        _rt: rt,
    }
}

pub struct Reply {
    pub status: u16,
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    /// The `data:` payloads of a server-sent event stream.
    pub fn events(&self) -> Vec<String> {
        String::from_utf8(self.body.clone())
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
            .collect()
    }
}

/// One HTTP/1.1 exchange over a fresh connection (`Connection: close`), chunked bodies decoded.
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8(raw[..split].to_vec()).unwrap();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers.get("transfer-encoding").map(String::as_str) == Some("chunked") {
        body = dechunk(&body);
    }
    Reply {
        status,
        headers,
        body,
    }
}

pub fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").unwrap();
        let size =
            usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[eol + 4 + size..];
    }
}

pub fn post(srv: &Server, path: &str, body: &Value) -> Reply {
    http(
        srv.addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

/// The library's greedy continuation of `prompt` (the reference for the server's answers).
pub fn library(
    engine: &Arc<Engine>,
    prompt: &[u32],
    max_tokens: usize,
    stop: &[&str],
) -> (String, usize) {
    let opts = GenerateOptions {
        max_tokens: Some(max_tokens),
        sampling: SamplingParams::default(),
        stop_strings: stop.iter().map(|s| s.to_string()).collect(),
        ..GenerateOptions::default()
    };
    let r = engine.generate_batch(prompt, &opts).unwrap();
    let row = &r.rows[0];
    (row.text.clone(), row.generated.len())
}

/// The value of an unlabelled metric.
pub fn metric(srv: &Server, name: &str) -> u64 {
    let m = String::from_utf8(http(srv.addr, "GET", "/metrics", &[], b"").body).unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} missing"))
        .parse()
        .unwrap()
}

/// Waits (up to 10 s) until no sequence runs or waits and no KV block is held but the prefix
/// cache's.
pub fn wait_until_idle(srv: &Server) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let running = metric(srv, "kiln_running_sequences") + metric(srv, "kiln_queue_waiting");
        let used = metric(srv, "kiln_kv_blocks_used");
        let cached = metric(srv, "kiln_prefix_cache_blocks");
        if running == 0 && used == cached {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "running {running}, blocks used {used}, cached {cached}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
