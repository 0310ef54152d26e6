//! The HTTP server end to end on loopback: a server on an ephemeral port over the tiny llama
//! fixture, driven by a minimal HTTP/1.1 client. Greedy answers are checked against the
//! library's own generation (`Engine::generate_batch`, which does not go through the
//! scheduler or the server).

mod server_support;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use kiln::tokenizer::ChatMessage;
use server_support::*;

#[test]
fn completions_match_the_library() {
    let srv = start(|_| {});
    let tok = srv.engine.tokenizer();
    let prompts = ["Once upon a time", "The quick brown fox"];
    let r = post(
        &srv,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompts, "max_tokens": 12, "temperature": 0, "future_field": [1]}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let mut prompt_tokens = 0;
    let mut completion_tokens = 0;
    for (i, p) in prompts.iter().enumerate() {
        let ids = tok.encode(p).unwrap();
        let (text, n) = library(&srv.engine, &ids, 12, &[]);
        assert_eq!(choices[i]["index"], i);
        assert_eq!(choices[i]["text"], text.as_str(), "prompt {i}");
        let reason = if n == 12 { "length" } else { "stop" };
        assert_eq!(choices[i]["finish_reason"], reason);
        prompt_tokens += ids.len();
        completion_tokens += n;
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], completion_tokens);
    assert_eq!(
        v["usage"]["total_tokens"],
        prompt_tokens + completion_tokens
    );
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());

    // Token ids give the same answer as the text they encode.
    let ids = tok.encode(prompts[0]).unwrap();
    let r = post(
        &srv,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 12, "temperature": 0.0}),
    );
    assert_eq!(r.json()["choices"][0]["text"], choices[0]["text"]);
}

#[test]
fn stop_strings_end_the_text_before_the_match() {
    let srv = start(|_| {});
    let ids = srv.engine.tokenizer().encode("Once upon a time").unwrap();
    let (full, _) = library(&srv.engine, &ids, 24, &[]);
    // A stop string taken from the middle of the greedy answer.
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 8, "{full:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let (expected, _) = library(&srv.engine, &ids, 24, &[&stop]);
    for stops in [json!(stop), json!(["never-appears", stop])] {
        let r = post(
            &srv,
            "/v1/completions",
            &json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stop": stops}),
        );
        let v = r.json();
        assert_eq!(v["choices"][0]["text"], expected.as_str());
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
}

#[test]
fn chat_streamed_equals_chat_whole() {
    let srv = start(|_| {});
    let messages = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say hello"}]},
    ]);
    let prompt = srv
        .engine
        .tokenizer()
        .chat_prompt(&[
            ChatMessage::new("system", "You are terse."),
            ChatMessage::new("user", "Say hello"),
        ])
        .unwrap();
    let (expected, n) = library(&srv.engine, &prompt, 10, &[]);
    let whole = post(
        &srv,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": messages, "max_completion_tokens": 10, "temperature": 0}),
    )
    .json();
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    assert_eq!(whole["choices"][0]["message"]["content"], expected.as_str());
    assert_eq!(whole["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(whole["usage"]["completion_tokens"], n);

    let r = post(
        &srv,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 10, "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true}}),
    );
    assert_eq!(r.status, 200);
    assert!(r.headers["content-type"].starts_with("text/event-stream"));
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    let mut reasons = Vec::new();
    for c in &chunks[..chunks.len() - 1] {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert!(c["usage"].is_null());
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
        if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
            reasons.push(f.to_string());
        }
    }
    assert_eq!(text, expected);
    assert_eq!(
        reasons,
        vec![whole["choices"][0]["finish_reason"].as_str().unwrap()]
    );
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], n);
    // The same system prompt again: its blocks come from the prefix cache.
    assert!(
        last["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[test]
fn n_choices_and_seeds() {
    let srv = start(|_| {});
    let body = json!({"prompt": "Once", "max_tokens": 16, "temperature": 1.0, "n": 3, "seed": 7, "top_k": 40, "min_p": 0.01});
    let a = post(&srv, "/v1/completions", &body).json();
    let b = post(&srv, "/v1/completions", &body).json();
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(texts(&a).len(), 3);
    assert_eq!(texts(&a), texts(&b), "the same seed gives the same choices");
    let c = post(
        &srv,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 16, "temperature": 1.0, "n": 3, "seed": 8, "top_k": 40, "min_p": 0.01}),
    )
    .json();
    assert_ne!(texts(&a), texts(&c), "another seed gives other choices");

    // Streamed with n = 2: each choice's chunks carry its index.
    let r = post(
        &srv,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 16, "temperature": 1.0, "n": 3, "seed": 7, "top_k": 40, "min_p": 0.01, "stream": true}),
    );
    let mut streamed = vec![String::new(); 3];
    for e in r.events() {
        if e == "[DONE]" {
            continue;
        }
        let c: Value = serde_json::from_str(&e).unwrap();
        let ch = &c["choices"][0];
        streamed[ch["index"].as_u64().unwrap() as usize].push_str(ch["text"].as_str().unwrap());
    }
    assert_eq!(streamed, texts(&a));
}

#[test]
fn bad_requests_get_openai_errors_naming_the_field() {
    let srv = start(|_| {});
    let cases: Vec<(&str, Vec<u8>, u16, Option<&str>)> = vec![
        ("/v1/completions", b"{not json".to_vec(), 400, None),
        ("/v1/completions", b"[1, 2]".to_vec(), 400, None),
        ("/v1/completions", vec![0xff, 0xfe, b'{'], 400, None),
        ("/v1/completions", json!({"max_tokens": 3}).to_string().into_bytes(), 400, Some("prompt")),
        ("/v1/completions", json!({"prompt": "x", "temperature": "hot"}).to_string().into_bytes(), 400, Some("temperature")),
        ("/v1/completions", json!({"prompt": "x", "temperature": 7}).to_string().into_bytes(), 400, Some("temperature")),
        ("/v1/completions", json!({"prompt": "x", "n": -1}).to_string().into_bytes(), 400, Some("n")),
        ("/v1/completions", json!({"prompt": "x", "n": 1e300}).to_string().into_bytes(), 400, Some("n")),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 1.5}).to_string().into_bytes(), 400, Some("max_tokens")),
        ("/v1/completions", json!({"prompt": "x", "stop": 3}).to_string().into_bytes(), 400, Some("stop")),
        ("/v1/completions", json!({"prompt": "x", "stream": "yes"}).to_string().into_bytes(), 400, Some("stream")),
        ("/v1/completions", json!({"prompt": "x", "logprobs": 21}).to_string().into_bytes(), 400, Some("logprobs")),
        ("/v1/completions", json!({"prompt": [1, 99999999]}).to_string().into_bytes(), 400, Some("prompt")),
        ("/v1/completions", json!({"prompt": vec![5u32; 300]}).to_string().into_bytes(), 400, Some("prompt")),
        ("/v1/completions", json!({"prompt": "x", "model": "gpt-9"}).to_string().into_bytes(), 404, Some("model")),
        ("/v1/chat/completions", json!({"messages": "hi"}).to_string().into_bytes(), 400, Some("messages")),
        ("/v1/chat/completions", json!({"messages": [{"role": 1, "content": "x"}]}).to_string().into_bytes(), 400, Some("messages[0].role")),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).to_string().into_bytes(), 400, Some("top_logprobs")),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 1}}).to_string().into_bytes(), 400, Some("stream_options.include_usage")),
        ("/v1/completions", vec![b' '; 100 << 10], 413, None),
    ];
    for (path, body, status, param) in cases {
        let r = http(
            srv.addr,
            "POST",
            path,
            &[("Content-Type", "application/json")],
            &body,
        );
        let shown = String::from_utf8_lossy(&body[..body.len().min(80)]).into_owned();
        assert_eq!(
            r.status,
            status,
            "{shown}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let v = r.json();
        let err = &v["error"];
        assert!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{shown}"
        );
        assert!(err["type"].is_string(), "{shown}");
        assert!(err.as_object().unwrap().contains_key("code"), "{shown}");
        if status == 413 {
            // Its body is left unread: the connection must not be reused.
            assert_eq!(
                r.headers.get("connection").map(String::as_str),
                Some("close")
            );
        }
        match param {
            Some(p) => assert_eq!(err["param"], p, "{shown}: {v}"),
            None => assert!(err["param"].is_null(), "{shown}"),
        }
    }
    // Penalties are applied, not refused; the server still serves after all of the above.
    let r = post(
        &srv,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 4, "presence_penalty": 1.5, "frequency_penalty": 0.5}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(http(srv.addr, "GET", "/nowhere", &[], b"").status, 404);
}

#[test]
fn api_key_models_health_and_metrics() {
    let srv = start(|c| c.api_key = Some("sesame".into()));
    assert_eq!(http(srv.addr, "GET", "/health", &[], b"").status, 200);
    let r = http(srv.addr, "GET", "/v1/models", &[], b"");
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    assert_eq!(
        http(
            srv.addr,
            "GET",
            "/v1/models",
            &[("Authorization", "Bearer sesamE")],
            b""
        )
        .status,
        401
    );
    let auth = [("Authorization", "Bearer sesame")];
    let r = http(srv.addr, "GET", "/v1/models", &auth, b"");
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["data"][0]["id"], MODEL);
    let r = http(
        srv.addr,
        "POST",
        "/v1/completions",
        &[auth[0], ("Content-Type", "application/json")],
        // Greedy and past the end-of-text token, so exactly 3 tokens (at the default temperature
        // 1 the first sampled token was once the end of text, and 1 was generated).
        json!({"prompt": "Once", "max_tokens": 3, "temperature": 0, "ignore_eos": true})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.status, 200);
    let prompt = srv.engine.tokenizer().encode("Once").unwrap();
    let want = [
        "kiln_requests_total{status=\"401\"} 2\n".to_string(),
        "kiln_time_to_first_token_seconds_count 1\n".to_string(),
        format!("kiln_prompt_tokens_total {}\n", prompt.len()),
        "kiln_generation_tokens_total 3\n".to_string(),
    ];
    // The scheduler publishes its counters just after the step that answered the request.
    let deadline = Instant::now() + Duration::from_secs(10);
    let m = loop {
        let m = String::from_utf8(http(srv.addr, "GET", "/metrics", &auth, b"").body).unwrap();
        if want.iter().all(|w| m.contains(w.as_str())) {
            break m;
        }
        assert!(Instant::now() < deadline, "{want:?} not all in\n{m}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(m.contains("kiln_kv_blocks_free "), "{m}");
    // /health, /v1/models and the completion at least (the polls above add more).
    let ok: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("kiln_requests_total{status=\"200\"} "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(ok >= 3, "{m}");
}

#[test]
fn a_full_queue_answers_429() {
    let srv = start(|c| {
        c.max_running = 1;
        c.max_queue = 0;
    });
    let r = post(
        &srv,
        "/v1/completions",
        &json!({"prompt": ["a", "b"], "max_tokens": 2}),
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.headers.get("retry-after").map(String::as_str), Some("1"));
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    // The refused request took no place: a single prompt still goes through.
    let r = post(
        &srv,
        "/v1/completions",
        &json!({"prompt": "a", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200);
}

#[test]
fn a_client_that_disconnects_frees_its_blocks() {
    let srv = start(|_| {});
    let body = json!({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 1.0, "seed": 1, "stream": true})
        .to_string();
    let mut s = TcpStream::connect(srv.addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    let got = s.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..got]).starts_with("HTTP/1.1 200"));
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let running = metric(&srv, "kiln_running_sequences") + metric(&srv, "kiln_queue_waiting");
        let used = metric(&srv, "kiln_kv_blocks_used");
        let cached = metric(&srv, "kiln_prefix_cache_blocks");
        if running == 0 && used == cached {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "running {running}, blocks used {used}, cached {cached}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Reads a streamed completion's choices' texts and its usage; `None` if the client hung up
/// after the first event (`hang_up`).
fn stream_completion(
    addr: SocketAddr,
    body: &Value,
    hang_up: bool,
) -> Option<(Vec<String>, Value)> {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    if hang_up {
        let mut first = [0u8; 256];
        let _ = s.read(&mut first).unwrap();
        return None;
    }
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let reply = Reply {
        status: 200,
        headers: HashMap::new(),
        body: dechunk(&raw[split + 4..]),
    };
    let mut texts = Vec::new();
    let mut usage = Value::Null;
    for e in reply.events() {
        if e == "[DONE]" {
            continue;
        }
        let c: Value = serde_json::from_str(&e).unwrap();
        if !c["usage"].is_null() {
            usage = c["usage"].clone();
        }
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            if texts.len() <= i {
                texts.resize(i + 1, String::new());
            }
            texts[i].push_str(ch["text"].as_str().unwrap());
        }
    }
    Some((texts, usage))
}

#[test]
fn many_concurrent_streams_equal_their_runs_alone() {
    let srv = start(|_| {});
    let vocab = srv.engine.config().vocab_size;
    struct Case {
        prompt: Vec<u32>,
        max_tokens: usize,
        n: usize,
        hang_up: bool,
        expected: (String, usize),
    }
    let cases: Vec<Case> = (0..64usize)
        .map(|c| {
            let len = 3 + (c * 7) % 40;
            let prompt: Vec<u32> = (0..len)
                .map(|j| (3 + (c * 31 + j * 17) % (vocab - 3)) as u32)
                .collect();
            let max_tokens = 4 + c % 13;
            Case {
                expected: library(&srv.engine, &prompt, max_tokens, &[]),
                prompt,
                max_tokens,
                n: if c % 4 == 0 { 2 } else { 1 },
                hang_up: c % 8 == 7,
            }
        })
        .collect();
    let addr = srv.addr;
    std::thread::scope(|scope| {
        for (c, case) in cases.iter().enumerate() {
            scope.spawn(move || {
                let body = json!({
                    "prompt": case.prompt, "max_tokens": case.max_tokens, "n": case.n,
                    "temperature": 0, "top_k": 5 + c, "stream": true,
                    "stream_options": {"include_usage": true},
                });
                let Some((texts, usage)) = stream_completion(addr, &body, case.hang_up) else {
                    return;
                };
                assert_eq!(texts, vec![case.expected.0.clone(); case.n], "client {c}");
                assert_eq!(
                    usage["completion_tokens"],
                    case.expected.1 * case.n,
                    "client {c}"
                );
                assert_eq!(usage["prompt_tokens"], case.prompt.len(), "client {c}");
            });
        }
    });
    // Every request ended or was cancelled: no sequence left, no block held but the cache's.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let running = metric(&srv, "kiln_running_sequences") + metric(&srv, "kiln_queue_waiting");
        let used = metric(&srv, "kiln_kv_blocks_used");
        let cached = metric(&srv, "kiln_prefix_cache_blocks");
        if running == 0 && used == cached {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "running {running}, blocks used {used}, cached {cached}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_slow_client_does_not_hold_up_the_others() {
    let srv = start(|_| {});
    // Headers sent, the body promised and one byte of it given: the handler waits on it.
    let mut slow = TcpStream::connect(srv.addr).unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        .unwrap();
    let mut half = TcpStream::connect(srv.addr).unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nHo")
        .unwrap();
    for _ in 0..3 {
        let r = post(
            &srv,
            "/v1/completions",
            &json!({"prompt": "Once", "max_tokens": 4}),
        );
        assert_eq!(r.status, 200);
    }
    // The slow body, once finished, is still answered (here: malformed JSON).
    slow.write_all(&[b' '; 99]).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut raw = [0u8; 64];
    let got = slow.read(&mut raw).unwrap();
    assert!(String::from_utf8_lossy(&raw[..got]).starts_with("HTTP/1.1 400"));
}
