//! The server under malformed and hostile requests, sent concurrently with a normal streaming
//! request: each gets its status (and, from the API, an OpenAI error naming the field), slow
//! and idle clients are cut off by the read timeout, and the normal request's answer is
//! exactly the library's. And a spawned `kiln serve`'s memory under load: its peak resident
//! size stays within the KV budget plus a fixed overhead.

mod server_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use server_support::*;

const KEY: &str = "sesame";
const AUTH: (&str, &str) = ("Authorization", "Bearer sesame");

/// One hostile request and what it must get.
struct Case {
    method: &'static str,
    path: &'static str,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    status: u16,
    /// `Some(p)`: an OpenAI error object whose `param` is `p` (`Some(None)`: null).
    param: Option<Option<&'static str>>,
}

fn api(path: &'static str, body: Vec<u8>, status: u16, param: Option<&'static str>) -> Case {
    Case {
        method: "POST",
        path,
        headers: vec![
            (AUTH.0.into(), AUTH.1.into()),
            ("Content-Type".into(), "application/json".into()),
        ],
        body,
        status,
        param: Some(param),
    }
}

fn completion(fields: Value, status: u16, param: Option<&'static str>) -> Case {
    let mut body = json!({"prompt": "x", "max_tokens": 2});
    for (k, v) in fields.as_object().unwrap() {
        body[k] = v.clone();
    }
    api(
        "/v1/completions",
        body.to_string().into_bytes(),
        status,
        param,
    )
}

fn chat(fields: Value, status: u16, param: Option<&'static str>) -> Case {
    let mut body = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2});
    for (k, v) in fields.as_object().unwrap() {
        body[k] = v.clone();
    }
    api(
        "/v1/chat/completions",
        body.to_string().into_bytes(),
        status,
        param,
    )
}

fn raw(
    method: &'static str,
    path: &'static str,
    headers: &[(&str, &str)],
    body: &[u8],
    status: u16,
) -> Case {
    Case {
        method,
        path,
        headers: headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        body: body.to_vec(),
        status,
        param: Some(None),
    }
}

fn cases() -> Vec<Case> {
    let c = completion;
    let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
    let mut v = vec![
        // Not JSON, or not an object.
        api("/v1/completions", b"{not json".to_vec(), 400, None),
        api("/v1/completions", b"[1, 2]".to_vec(), 400, None),
        api("/v1/completions", b"null".to_vec(), 400, None),
        api("/v1/completions", b"".to_vec(), 400, None),
        api("/v1/completions", vec![0xff, 0xfe, b'{'], 400, None),
        api(
            "/v1/completions",
            b"{\"prompt\": \"\xff\xfe\"}".to_vec(),
            400,
            None,
        ),
        api(
            "/v1/completions",
            b"{\"prompt\": \"x\", \"temperature\": NaN}".to_vec(),
            400,
            None,
        ),
        api(
            "/v1/completions",
            b"{\"prompt\": \"x\", \"temperature\": Infinity}".to_vec(),
            400,
            None,
        ),
        api(
            "/v1/completions",
            b"{\"prompt\": \"x\", \"temperature\": 1e999}".to_vec(),
            400,
            None,
        ),
        api("/v1/completions", deep.into_bytes(), 400, None),
        // The prompt.
        api("/v1/completions", b"{}".to_vec(), 400, Some("prompt")),
        c(json!({"prompt": 5}), 400, Some("prompt")),
        c(json!({"prompt": []}), 400, Some("prompt")),
        c(json!({"prompt": [[]]}), 400, Some("prompt")),
        c(json!({"prompt": [1, -1]}), 400, Some("prompt")),
        c(json!({"prompt": [1, 1e20]}), 400, Some("prompt")),
        c(json!({"prompt": [1, 99_999_999]}), 400, Some("prompt")),
        c(json!({"prompt": [1, "a"]}), 400, Some("prompt")),
        c(json!({"prompt": vec!["a"; 65]}), 400, Some("prompt")),
        // Over the context (256 positions): refused, naming the prompt.
        c(json!({"prompt": vec![5u32; 300]}), 400, Some("prompt")),
        c(json!({"prompt": "x ".repeat(400)}), 400, Some("prompt")),
        // Numbers: wrong types, out of range, huge.
        c(json!({"temperature": "hot"}), 400, Some("temperature")),
        c(json!({"temperature": 7}), 400, Some("temperature")),
        c(json!({"temperature": -1}), 400, Some("temperature")),
        c(json!({"temperature": 1e308}), 400, Some("temperature")),
        c(json!({"n": -1}), 400, Some("n")),
        c(json!({"n": 0}), 400, Some("n")),
        c(json!({"n": 65}), 400, Some("n")),
        c(json!({"n": 1e300}), 400, Some("n")),
        c(json!({"n": "3"}), 400, Some("n")),
        api(
            "/v1/completions",
            b"{\"prompt\": \"x\", \"n\": 18446744073709551616}".to_vec(),
            400,
            Some("n"),
        ),
        c(json!({"max_tokens": 0}), 400, Some("max_tokens")),
        c(json!({"max_tokens": -5}), 400, Some("max_tokens")),
        c(json!({"max_tokens": 1.5}), 400, Some("max_tokens")),
        c(
            json!({"max_tokens": 99_999_999_999u64}),
            400,
            Some("max_tokens"),
        ),
        c(json!({"top_p": 0}), 400, Some("top_p")),
        c(json!({"top_p": 1.5}), 400, Some("top_p")),
        c(json!({"top_k": -2}), 400, Some("top_k")),
        c(json!({"top_k": "a"}), 400, Some("top_k")),
        c(json!({"min_p": 2}), 400, Some("min_p")),
        c(
            json!({"repetition_penalty": 0}),
            400,
            Some("repetition_penalty"),
        ),
        c(
            json!({"presence_penalty": 3}),
            400,
            Some("presence_penalty"),
        ),
        c(
            json!({"frequency_penalty": -3}),
            400,
            Some("frequency_penalty"),
        ),
        c(json!({"seed": "x"}), 400, Some("seed")),
        c(json!({"seed": 1.5}), 400, Some("seed")),
        c(json!({"stop": 3}), 400, Some("stop")),
        c(json!({"stop": [1]}), 400, Some("stop")),
        c(json!({"stop": vec!["a"; 17]}), 400, Some("stop")),
        c(json!({"stop": [""]}), 400, Some("stop")),
        c(json!({"stream": "yes"}), 400, Some("stream")),
        c(json!({"stream_options": 1}), 400, Some("stream_options")),
        c(json!({"logprobs": 21}), 400, Some("logprobs")),
        c(json!({"logprobs": -1}), 400, Some("logprobs")),
        c(json!({"echo": true}), 400, Some("echo")),
        c(json!({"best_of": 3}), 400, Some("best_of")),
        c(json!({"logit_bias": {"1": 5}}), 400, Some("logit_bias")),
        c(json!({"model": "gpt-9"}), 404, Some("model")),
        c(json!({"model": 5}), 400, Some("model")),
        // Chat.
        chat(json!({"messages": "hi"}), 400, Some("messages")),
        chat(json!({"messages": []}), 400, Some("messages")),
        chat(json!({"messages": [1]}), 400, Some("messages[0]")),
        chat(
            json!({"messages": [{"role": 1, "content": "x"}]}),
            400,
            Some("messages[0].role"),
        ),
        chat(
            json!({"messages": [{"role": "user", "content": 5}]}),
            400,
            Some("messages[0].content"),
        ),
        chat(
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            400,
            Some("messages[0].content[0]"),
        ),
        chat(json!({"top_logprobs": 2}), 400, Some("top_logprobs")),
        chat(
            json!({"logprobs": true, "top_logprobs": 99}),
            400,
            Some("top_logprobs"),
        ),
        chat(json!({"tools": [{"type": "function"}]}), 400, Some("tools")),
        chat(
            json!({"response_format": {"type": "xml"}}),
            400,
            Some("response_format.type"),
        ),
        chat(
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}}}),
            400,
            Some("response_format"),
        ),
        chat(
            json!({"max_completion_tokens": -1}),
            400,
            Some("max_completion_tokens"),
        ),
        // Auth.
        raw(
            "POST",
            "/v1/completions",
            &[("Content-Type", "application/json")],
            b"{\"prompt\": \"x\"}",
            401,
        ),
        raw(
            "POST",
            "/v1/completions",
            &[("Authorization", "Bearer sesamE")],
            b"{\"prompt\": \"x\"}",
            401,
        ),
        raw(
            "GET",
            "/v1/models",
            &[("Authorization", "Basic c2VzYW1l")],
            b"",
            401,
        ),
        raw(
            "GET",
            "/metrics",
            &[("Authorization", "Bearer sesame sesame")],
            b"",
            401,
        ),
        // Routes and methods.
        raw("GET", "/v1/engines", &[AUTH], b"", 404),
        raw("POST", "/v1/embeddings", &[AUTH], b"{}", 404),
        raw("GET", "/v1/completions", &[AUTH], b"", 405),
        raw("DELETE", "/v1/models", &[AUTH], b"", 405),
        raw("POST", "/health", &[], b"", 405),
    ];
    // A body over the cap (64 KiB here): 413, answered without reading the rest.
    v.push(api("/v1/completions", vec![b' '; 10 << 20], 413, None));
    // Malformed HTTP, answered by the HTTP layer (no JSON body).
    for (head, status) in [
        ("GARBAGE\r\n\r\n", 400),
        (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
            400,
        ),
    ] {
        v.push(Case {
            method: "",
            path: "",
            headers: Vec::new(),
            body: head.as_bytes().to_vec(),
            status,
            param: None,
        });
    }
    let many: Vec<(String, String)> = (0..150)
        .map(|i| (format!("X-Header-{i}"), "1".to_string()))
        .collect();
    v.push(Case {
        method: "GET",
        path: "/v1/models",
        headers: many,
        body: Vec::new(),
        status: 431,
        param: None,
    });
    v
}

/// Sends a case and reads the status line and body; the writer runs on its own thread so a
/// server that answers before reading the whole body (413) is read meanwhile.
fn send(addr: SocketAddr, case: &Case) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let bytes = if case.method.is_empty() {
        case.body.clone()
    } else {
        let mut head = format!(
            "{} {} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n",
            case.method,
            case.path,
            case.body.len()
        );
        for (k, v) in &case.headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let mut b = head.into_bytes();
        b.extend_from_slice(&case.body);
        b
    };
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        // The server may close before taking it all (413): that is its answer, not an error.
        let _ = w.write_all(&bytes);
    });
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => raw.extend_from_slice(&buf[..k]),
            // A reset after the answer (the unread rest of a refused body).
            Err(_) if !raw.is_empty() => break,
            Err(e) => panic!("{} {}: {e}", case.method, case.path),
        }
    }
    drop(s);
    let _ = writer.join();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head: {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let mut body = raw[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    (status, body)
}

/// Sends `bytes` one at a time, `every` apart, until the server closes the connection; returns
/// what it answered and how long it took.
fn trickle(addr: SocketAddr, bytes: &[u8], every: Duration) -> (Vec<u8>, Duration) {
    let start = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(every)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    for b in bytes.iter().chain(std::iter::repeat(&b' ')) {
        if s.write_all(&[*b]).is_err() {
            break;
        }
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => got.extend_from_slice(&buf[..k]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => break,
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "a slow client was never cut off"
        );
    }
    (got, start.elapsed())
}

#[test]
fn hostile_requests_get_their_status_while_a_stream_is_served() {
    let srv = start(|c| {
        c.api_key = Some(KEY.into());
        c.read_timeout = Duration::from_secs(1);
    });
    let addr = srv.addr;
    let cases = cases();
    assert!(cases.len() >= 50, "{} cases", cases.len());
    println!("{} hostile requests", cases.len());
    let prompt = srv.engine.tokenizer().encode("Once upon a time").unwrap();
    let (expected, _) = library(&srv.engine, &prompt, 40, &[]);
    std::thread::scope(|scope| {
        // The normal client: a greedy stream.
        let normal = scope.spawn(move || {
            let body = json!({"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
                              "stream": true})
            .to_string();
            let r = http(
                addr,
                "POST",
                "/v1/completions",
                &[AUTH, ("Content-Type", "application/json")],
                body.as_bytes(),
            );
            assert_eq!(r.status, 200);
            let mut text = String::new();
            for e in r.events() {
                if e != "[DONE]" {
                    let c: Value = serde_json::from_str(&e).unwrap();
                    text.push_str(c["choices"][0]["text"].as_str().unwrap());
                }
            }
            text
        });
        // Slow and idle clients, cut off by the 1 s read timeout.
        let slow_head = scope.spawn(move || {
            trickle(
                addr,
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                Duration::from_millis(200),
            )
        });
        let slow_body = scope.spawn(move || {
            let head = format!(
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\n{}: {}\r\nContent-Length: 1000\r\n\r\n",
                AUTH.0, AUTH.1
            );
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(head.as_bytes()).unwrap();
            trickle_on(s, Duration::from_millis(200))
        });
        let idle = scope.spawn(move || {
            let start = Instant::now();
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut buf = [0u8; 64];
            let got = s.read(&mut buf).unwrap_or(0);
            (got, start.elapsed())
        });
        // The hostile requests, eight at a time.
        let chunks: Vec<&[Case]> = cases.chunks(cases.len().div_ceil(8)).collect();
        for part in chunks {
            scope.spawn(move || {
                for case in part {
                    let (status, body) = send(addr, case);
                    let shown = format!(
                        "{} {} {:?}",
                        case.method,
                        case.path,
                        String::from_utf8_lossy(&case.body[..case.body.len().min(100)])
                    );
                    assert_eq!(
                        status,
                        case.status,
                        "{shown}: {}",
                        String::from_utf8_lossy(&body)
                    );
                    if let Some(param) = case.param {
                        let v: Value = serde_json::from_slice(&body).unwrap_or_else(|e| {
                            panic!("{shown}: {e}: {}", String::from_utf8_lossy(&body))
                        });
                        let err = &v["error"];
                        assert!(
                            err["message"].as_str().is_some_and(|m| !m.is_empty()),
                            "{shown}"
                        );
                        assert!(err["type"].is_string(), "{shown}");
                        assert!(err.as_object().unwrap().contains_key("code"), "{shown}");
                        assert_eq!(err["param"], json!(param), "{shown}: {v}");
                    }
                }
            });
        }
        assert_eq!(normal.join().unwrap(), expected);
        let (got, took) = slow_head.join().unwrap();
        assert!(
            took < Duration::from_secs(5),
            "slow head held {took:?}: {}",
            String::from_utf8_lossy(&got)
        );
        let (got, took) = slow_body.join().unwrap();
        assert!(took < Duration::from_secs(5), "slow body held {took:?}");
        assert!(
            String::from_utf8_lossy(&got).starts_with("HTTP/1.1 408"),
            "{}",
            String::from_utf8_lossy(&got)
        );
        let (got, took) = idle.join().unwrap();
        assert_eq!(got, 0, "an idle connection got an answer");
        assert!(
            took < Duration::from_secs(5),
            "an idle connection held {took:?}"
        );
    });
    // Still serving, and nothing left running.
    let r = http(addr, "GET", "/v1/models", &[AUTH], b"");
    assert_eq!(r.status, 200);
    wait_until_idle_with(&srv, &[AUTH]);
}

/// [`trickle`] on a connection already open, sending spaces.
fn trickle_on(mut s: TcpStream, every: Duration) -> (Vec<u8>, Duration) {
    let start = Instant::now();
    s.set_read_timeout(Some(every)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while start.elapsed() < Duration::from_secs(20) {
        if s.write_all(b" ").is_err() {
            break;
        }
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => got.extend_from_slice(&buf[..k]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    (got, start.elapsed())
}

fn wait_until_idle_with(srv: &Server, auth: &[(&str, &str)]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let metric = |name: &str| -> u64 {
        let m = String::from_utf8(http(srv.addr, "GET", "/metrics", auth, b"").body).unwrap();
        m.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing"))
            .parse()
            .unwrap()
    };
    loop {
        let running = metric("kiln_running_sequences") + metric("kiln_queue_waiting");
        let used = metric("kiln_kv_blocks_used");
        let cached = metric("kiln_prefix_cache_blocks");
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

/// `VmRSS` and `VmHWM` (peak) of a process, in bytes.
fn memory(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().strip_suffix("kB"))
            .map(|v| v.trim().parse::<u64>().unwrap() * 1024)
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// A spawned `kiln serve` with an 8 MiB KV budget under 64 concurrent streams (long and short
/// prompts, n up to 3, a quarter hanging up): its peak resident size grows past what it held
/// idle by less than the budget plus a fixed 24 MiB (request buffers, thread stacks, the
/// allocator's slack), and afterwards no block is held but the prefix cache's.
#[test]
fn serve_memory_stays_within_the_kv_budget() {
    const BUDGET: u64 = 8 << 20;
    const OVERHEAD: u64 = 24 << 20;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "serve",
            "-m",
            FIXTURE,
            "--port",
            "0",
            "--kv-budget",
            "8M",
            "-t",
            "1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut err = child.stderr.take().unwrap();
    // "kiln: serving "NAME" on http://ADDR/v1 (...)"
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while !String::from_utf8_lossy(&line).contains("/v1") {
        assert_eq!(
            err.read(&mut b).unwrap(),
            1,
            "{}",
            String::from_utf8_lossy(&line)
        );
        line.push(b[0]);
    }
    let line = String::from_utf8_lossy(&line).into_owned();
    let addr: SocketAddr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.strip_suffix("/v1"))
        .unwrap()
        .parse()
        .unwrap();
    // The server's stderr, kept for the failure message (a crash would otherwise not show).
    let stderr = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = std::sync::Arc::clone(&stderr);
    std::thread::spawn(move || {
        let mut b = [0u8; 4096];
        while let Ok(n) = err.read(&mut b) {
            if n == 0 {
                break;
            }
            sink.lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend_from_slice(&b[..n]);
        }
    });
    let body = |c: usize| {
        json!({"prompt": "Once upon a time ".repeat(1 + c % 12), "max_tokens": 8 + c % 24,
               "n": 1 + c % 3, "temperature": 0.8, "seed": c, "stream": true})
    };
    // Warm up: one request of each shape, then the idle size.
    for c in 0..3 {
        assert_eq!(
            post_to(addr, &body(c)).status,
            200,
            "warm-up request {c} failed"
        );
    }
    let (idle, _) = memory(pid);
    // Each client's failure, if any: all of them are reported together, with whether the
    // server is still running and its stderr.
    let failures: Vec<String> = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..64)
            .map(|c| {
                scope.spawn(move || -> Result<(), String> {
                    let b = body(c).to_string();
                    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
                    s.set_read_timeout(Some(Duration::from_secs(60)))
                        .map_err(|e| e.to_string())?;
                    write!(
                        s,
                        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
                        b.len()
                    )
                    .map_err(|e| format!("write: {e}"))?;
                    if c % 4 == 3 {
                        let mut first = [0u8; 256];
                        s.read(&mut first).map_err(|e| format!("read (hanging up): {e}"))?;
                        return Ok(());
                    }
                    let mut raw = Vec::new();
                    s.read_to_end(&mut raw).map_err(|e| {
                        format!("read after {} bytes: {e}", raw.len())
                    })?;
                    let text = String::from_utf8_lossy(&raw);
                    if text.contains("[DONE]") {
                        Ok(())
                    } else {
                        Err(format!("no [DONE] in: {}", text.chars().take(300).collect::<String>()))
                    }
                })
            })
            .collect();
        clients
            .into_iter()
            .enumerate()
            .filter_map(|(c, h)| match h.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!("client {c}: {e}")),
                Err(_) => Some(format!("client {c}: panicked")),
            })
            .collect()
    });
    if !failures.is_empty() {
        let alive = child.try_wait().map(|s| s.is_none()).unwrap_or(false);
        let _ = child.kill();
        let log =
            String::from_utf8_lossy(&stderr.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
        panic!(
            "{} of 64 clients failed (server {}):\n{}\nserver stderr (last 3000 bytes):\n{}",
            failures.len(),
            if alive { "still running" } else { "exited" },
            failures.join("\n"),
            &log[(log.len().saturating_sub(3000)..log.len())
                .find(|&i| log.is_char_boundary(i))
                .unwrap_or(log.len())..]
        );
    }
    let (_, peak) = memory(pid);
    let grown = peak.saturating_sub(idle);
    let wait = Instant::now() + Duration::from_secs(10);
    loop {
        let m = String::from_utf8(http(addr, "GET", "/metrics", &[], b"").body).unwrap();
        let get = |name: &str| -> u64 {
            m.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .unwrap()
                .parse()
                .unwrap()
        };
        let busy = get("kiln_running_sequences") + get("kiln_queue_waiting");
        if busy == 0 && get("kiln_kv_blocks_used") == get("kiln_prefix_cache_blocks") {
            break;
        }
        assert!(Instant::now() < wait, "blocks still held:\n{m}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    println!("idle {idle} B, peak {peak} B, grown {grown} B");
    assert!(
        grown <= BUDGET + OVERHEAD,
        "the peak resident size grew {grown} B past the idle {idle} B (budget {BUDGET} + {OVERHEAD})"
    );
}

fn post_to(addr: SocketAddr, body: &Value) -> Reply {
    http(
        addr,
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}
