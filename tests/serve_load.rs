//! The serving benchmark's client (`kiln-bench serve-load`, `kiln::bench::load`) against a real
//! `kiln serve` on the demo model, briefly: every request streams exactly `max_tokens` tokens
//! (the `ignore_eos` extension the workload relies on to give every server the same work),
//! and the table's counts add up.

mod common;

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use kiln::bench::load::http::{post_json, Url};

/// A `kiln serve` child process, killed when dropped.
struct Server {
    child: Child,
    url: Url,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(model: &std::path::Path) -> Server {
    // A free port: bound, read and released (the server binds it again at once).
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "-m"])
        .arg(model)
        .args(["--port", &port.to_string(), "-t", "2", "-c", "1024"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("kiln serve starts");
    let t0 = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("kiln serve exited before listening: {status}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "kiln serve did not listen on {port} within 120 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Server {
        child,
        url: Url::parse(&format!("http://127.0.0.1:{port}")).unwrap(),
    }
}

fn chat(url: &Url, extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 96,
        "temperature": 0,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let resp = post_json(
        url,
        "/v1/chat/completions",
        &body.to_string(),
        Duration::from_secs(300),
    )
    .expect("the request is answered");
    assert_eq!(resp.status, 200);
    let mut text = String::new();
    let mut b = resp.body;
    b.read_to_string(&mut text).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn serve_load_against_kiln_serve() {
    let Some(model) = common::demo_model() else {
        eprintln!("SKIPPED: demo model absent (scripts/fetch_demo_model.sh)");
        return;
    };
    let server = start(&model);

    // The premise: the model ends this answer itself, well before max_tokens...
    let natural = chat(&server.url, json!({}));
    assert_eq!(natural["choices"][0]["finish_reason"], "stop", "{natural}");
    let n = natural["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n < 96, "{natural}");
    // ...and ignore_eos makes it generate all of them.
    let forced = chat(&server.url, json!({"ignore_eos": true}));
    assert_eq!(forced["choices"][0]["finish_reason"], "length", "{forced}");
    assert_eq!(forced["usage"]["completion_tokens"], 96, "{forced}");
    let wrong = post_json(
        &server.url,
        "/v1/completions",
        r#"{"prompt": "x", "ignore_eos": "yes"}"#,
        Duration::from_secs(60),
    )
    .unwrap();
    assert_eq!(wrong.status, 400);

    let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args(["serve-load", "--url"])
        .arg(format!("http://127.0.0.1:{}", server.url.port))
        .args([
            "--concurrency",
            "1,3",
            "--max-tokens",
            "8",
            "--requests-per-client",
            "1",
        ])
        .args([
            "--min-requests",
            "2",
            "--warmup",
            "1",
            "--label",
            "kiln",
            "-o",
            "json",
        ])
        .output()
        .expect("kiln-bench runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (row, (clients, requests)) in rows.iter().zip([(1, 2), (3, 3)]) {
        assert_eq!(row["server"], "kiln");
        assert_eq!(row["concurrency"], clients, "{row}");
        assert_eq!(row["requests"], requests, "{row}");
        assert_eq!(row["errors"], 0, "{row}");
        assert_eq!(row["short"], 0, "{row}");
        assert_eq!(row["tokens"], requests * 8, "{row}");
        assert_eq!(row["tokens_from_usage"], true, "{row}");
        assert!(row["tokens_per_s"].as_f64().unwrap() > 0.0, "{row}");
        for key in ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"] {
            assert!(row[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {row}");
        }
    }

    // A server that is not there is a clear error naming the address.
    drop(server);
    let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args([
            "serve-load",
            "--url",
            "http://127.0.0.1:9",
            "--concurrency",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("127.0.0.1:9"), "{err}");
}
