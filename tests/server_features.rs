//! The server's generation options end to end on loopback: log-probabilities checked against a
//! log-softmax of the library's own logits, `response_format` outputs parsed and validated,
//! nanochat's calculator through the chat API, penalties and the sampling extensions checked
//! against the library, the usage options, and speculative decoding (`kiln serve --spec`).

mod common;
mod server_support;

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{json, Value};

use kiln::engine::{Engine, GenerateOptions, LogitsProcessor};
use kiln::sample::SamplingParams;
use server_support::*;

/// The model's log-softmax of `logits`, in f64 (the reference for the server's numbers).
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
    let z: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    logits.iter().map(|&l| l as f64 - max - z.ln()).collect()
}

/// For each of `tokens` generated after `prompt`: the log-softmax of the logits it was chosen
/// from, computed through a library session fed one token at a time.
fn reference_logprobs(engine: &Arc<Engine>, prompt: &[u32], tokens: &[u32]) -> Vec<Vec<f64>> {
    let mut s = engine.session(engine.max_context());
    let mut logits = s.feed(prompt).unwrap().to_vec();
    let mut out = Vec::new();
    for &t in tokens {
        out.push(log_softmax(&logits));
        logits = s.feed(&[t]).unwrap().to_vec();
    }
    out
}

/// The `k` largest values of `lp`, largest first.
fn top_values(lp: &[f64], k: usize) -> Vec<f64> {
    let mut v = lp.to_vec();
    v.sort_by(|a, b| b.partial_cmp(a).unwrap());
    v.truncate(k);
    v
}

fn close(got: &Value, want: f64, what: &str) {
    let g = got
        .as_f64()
        .unwrap_or_else(|| panic!("{what}: {got} is not a number"));
    assert!((g - want).abs() < 1e-4, "{what}: got {g}, want {want}");
}

/// Token id of each token's bytes (the fixture's vocabulary spells every token differently).
fn ids_by_bytes(engine: &Engine) -> HashMap<Vec<u8>, u32> {
    let table = engine.tokenizer().token_bytes().unwrap();
    let mut m = HashMap::new();
    for (id, t) in table.into_iter().enumerate() {
        if !t.bytes.is_empty() {
            assert!(m.insert(t.bytes, id as u32).is_none());
        }
    }
    m
}

/// The data payloads of a stream's chunks (without `[DONE]`).
fn chunks(r: &Reply) -> Vec<Value> {
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

#[test]
fn completion_logprobs_are_the_models_log_softmax() {
    let srv = start(|_| {});
    let e = &srv.engine;
    let tok = e.tokenizer();
    let prompt = tok.encode("Once upon a time").unwrap();
    let greedy = e
        .generate_batch(
            &prompt,
            &GenerateOptions {
                max_tokens: Some(10),
                sampling: SamplingParams::default(),
                ..GenerateOptions::default()
            },
        )
        .unwrap();
    let row = &greedy.rows[0];
    // A stop token ends the text and gets no entry.
    let taken: Vec<u32> = row
        .generated
        .iter()
        .copied()
        .filter(|t| !e.default_stop_tokens().contains(t))
        .collect();
    let reference = reference_logprobs(e, &prompt, &taken);
    let body = json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 3});
    let whole = post(&srv, "/v1/completions", &body).json();
    let lp = &whole["choices"][0]["logprobs"];
    assert_eq!(whole["choices"][0]["text"], row.text.as_str());
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), taken.len(), "{lp}");
    let mut offset = 0;
    for (i, (&t, want)) in taken.iter().zip(&reference).enumerate() {
        let text = tok.decode(&[t]).unwrap();
        if !text.contains('\u{fffd}') {
            assert_eq!(tokens[i], text.as_str(), "token {i}");
        }
        close(&lp["token_logprobs"][i], want[t as usize], "token_logprobs");
        // Greedy: the token taken is the most likely one.
        close(
            &lp["token_logprobs"][i],
            top_values(want, 1)[0],
            "greedy token",
        );
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!((3..=4).contains(&top.len()), "{top:?}");
        let mut got: Vec<f64> = top.values().map(|v| v.as_f64().unwrap()).collect();
        got.sort_by(|a, b| b.partial_cmp(a).unwrap());
        for (g, w) in got.iter().zip(top_values(want, 3)) {
            assert!((g - w).abs() < 1e-4, "top_logprobs {i}: {got:?}");
        }
        assert_eq!(lp["text_offset"][i], offset);
        offset += tokens[i].as_str().unwrap().chars().count();
    }

    // Streamed: the chunks' entries, joined, are the whole response's.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = post(&srv, "/v1/completions", &streamed);
    let mut joined: HashMap<&str, Vec<Value>> = HashMap::new();
    for c in chunks(&r) {
        let l = &c["choices"][0]["logprobs"];
        if l.is_null() {
            continue;
        }
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            joined
                .entry(key)
                .or_default()
                .extend(l[key].as_array().unwrap().iter().cloned());
        }
    }
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(json!(joined[key]), lp[key], "{key}");
    }

    // Without logprobs, none.
    let plain = post(
        &srv,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 3}),
    )
    .json();
    assert!(plain["choices"][0]["logprobs"].is_null());
}

/// Chat logprobs of a sampled stream are the model's raw distribution: not the temperature's,
/// nor the truncated one the token was drawn from.
#[test]
fn chat_logprobs_of_sampled_tokens_are_the_raw_distribution() {
    let srv = start(|_| {});
    let e = &srv.engine;
    let by_bytes = ids_by_bytes(e);
    let messages = json!([{"role": "user", "content": "Tell me a story"}]);
    let prompt = e
        .tokenizer()
        .chat_prompt(&[kiln::tokenizer::ChatMessage::new("user", "Tell me a story")])
        .unwrap();
    let r = post(
        &srv,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 12, "temperature": 0.5, "top_k": 4,
                "seed": 3, "logprobs": true, "top_logprobs": 2, "stream": true}),
    );
    assert_eq!(r.status, 200);
    let mut content = String::new();
    let mut entries = Vec::new();
    for c in chunks(&r) {
        let ch = &c["choices"][0];
        if let Some(t) = ch["delta"]["content"].as_str() {
            content.push_str(t);
        }
        if let Some(list) = ch["logprobs"]["content"].as_array() {
            entries.extend(list.iter().cloned());
        }
    }
    assert!(!entries.is_empty());
    let taken: Vec<u32> = entries
        .iter()
        .map(|en| {
            let bytes: Vec<u8> = en["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect();
            assert_eq!(en["token"], String::from_utf8_lossy(&bytes).as_ref());
            by_bytes[&bytes]
        })
        .collect();
    // The entries spell the content.
    let spelled: Vec<u8> = entries
        .iter()
        .flat_map(|en| {
            en["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(String::from_utf8_lossy(&spelled), content);
    let reference = reference_logprobs(e, &prompt, &taken);
    let mut below_top = 0;
    for (i, ((en, &t), want)) in entries.iter().zip(&taken).zip(&reference).enumerate() {
        close(&en["logprob"], want[t as usize], &format!("entry {i}"));
        let top = en["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        for (j, w) in top_values(want, 2).into_iter().enumerate() {
            close(&top[j]["logprob"], w, &format!("entry {i} top {j}"));
        }
        if want[t as usize] < top_values(want, 1)[0] {
            below_top += 1;
        }
    }
    // Sampling took some token that was not the most likely one (so this checked more than
    // greedy decoding would).
    assert!(below_top > 0, "every sampled token was the argmax");
}

/// A small validator for the schemas used here: object properties, required, enums, types.
fn validate(v: &Value, schema: &Value) -> Result<(), String> {
    if let Some(options) = schema["enum"].as_array() {
        return options
            .contains(v)
            .then_some(())
            .ok_or(format!("{v} not in {options:?}"));
    }
    match schema["type"].as_str() {
        Some("object") => {
            let o = v.as_object().ok_or(format!("{v} is not an object"))?;
            for r in schema["required"].as_array().into_iter().flatten() {
                if !o.contains_key(r.as_str().unwrap()) {
                    return Err(format!("{r} missing from {v}"));
                }
            }
            for (k, x) in o {
                match schema["properties"].get(k) {
                    Some(s) => validate(x, s)?,
                    None if schema["additionalProperties"] == json!(false) => {
                        return Err(format!("{k} is not allowed"))
                    }
                    None => {}
                }
            }
            Ok(())
        }
        Some("integer") => {
            let n = v.as_i64().ok_or(format!("{v} is not an integer"))?;
            let lo = schema["minimum"].as_i64().unwrap_or(i64::MIN);
            let hi = schema["maximum"].as_i64().unwrap_or(i64::MAX);
            (lo..=hi)
                .contains(&n)
                .then_some(())
                .ok_or(format!("{n} out of range"))
        }
        Some("boolean") => v
            .is_boolean()
            .then_some(())
            .ok_or(format!("{v} is not a boolean")),
        _ => Ok(()),
    }
}

#[test]
fn response_format_outputs_parse_and_validate() {
    let srv = start(|_| {});
    let schema = json!({
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "size", "ok"],
        "additionalProperties": false,
    });
    let messages = json!([{"role": "user", "content": "Describe a ball."}]);
    for (seed, stream) in [(1, false), (2, true), (3, false)] {
        let body = json!({
            "messages": messages, "max_tokens": 120, "temperature": 1.0, "seed": seed, "n": 2,
            "stream": stream,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "ball", "schema": schema, "strict": true}},
        });
        let r = post(&srv, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let mut texts = vec![String::new(); 2];
        let mut reasons = vec![Value::Null; 2];
        if stream {
            for c in chunks(&r) {
                for ch in c["choices"].as_array().unwrap() {
                    let i = ch["index"].as_u64().unwrap() as usize;
                    if let Some(t) = ch["delta"]["content"].as_str() {
                        texts[i].push_str(t);
                    }
                    if !ch["finish_reason"].is_null() {
                        reasons[i] = ch["finish_reason"].clone();
                    }
                }
            }
        } else {
            for ch in r.json()["choices"].as_array().unwrap() {
                let i = ch["index"].as_u64().unwrap() as usize;
                texts[i] = ch["message"]["content"].as_str().unwrap().to_string();
                reasons[i] = ch["finish_reason"].clone();
            }
        }
        for (t, reason) in texts.iter().zip(&reasons) {
            assert_eq!(reason, "stop", "{t:?}");
            let v: Value = serde_json::from_str(t).unwrap_or_else(|e| panic!("{e}: {t:?}"));
            validate(&v, &schema).unwrap_or_else(|e| panic!("{e}: {t}"));
        }
    }

    // Any JSON object: whatever the model writes within its budget is a prefix of one, and
    // what finishes parses as one.
    let mut finished = 0;
    for seed in 0..4 {
        let body = json!({
            "messages": messages, "max_tokens": 60, "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_object"},
        });
        let v = post(&srv, "/v1/chat/completions", &body).json();
        let ch = &v["choices"][0];
        let text = ch["message"]["content"].as_str().unwrap();
        assert!(text.trim_start().starts_with('{'), "{text:?}");
        if ch["finish_reason"] == "stop" {
            let parsed: Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            assert!(parsed.is_object(), "{text}");
            finished += 1;
        }
    }
    assert!(
        finished > 0,
        "no json_object output finished within its budget"
    );

    // Bad formats are refused, naming the field.
    for (rf, param) in [
        (json!("json"), "response_format"),
        (json!({"type": "xml"}), "response_format.type"),
        (
            json!({"type": "json_schema"}),
            "response_format.json_schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}),
            "response_format",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}),
            "response_format",
        ),
    ] {
        let r = post(
            &srv,
            "/v1/chat/completions",
            &json!({"messages": messages, "response_format": rf}),
        );
        assert_eq!(r.status, 400, "{rf}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["error"]["param"], param, "{rf}");
    }
}

/// A nanochat-vocabulary model that writes a calculator call: its logits depend only on the
/// last token (attention and MLP add nothing), and each token of `chain` predicts the next.
fn scripted_model(chain: &[u32]) -> Arc<Engine> {
    use kiln::model::{Architecture, Model, ModelConfig, RopeStyle, Tensor, Weights};
    let tokenizer = common::nanochat_tokenizer();
    let vocab = tokenizer.vocab_size();
    let (c, f, heads, kv, d) = (16, 32, 2, 1, 8);
    assert!(chain.len() <= c, "the chain needs a direction per token");
    let config = ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: vocab,
        hidden_size: c,
        num_layers: 1,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: d,
        intermediate_size: f,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        rope_style: RopeStyle::HalfSplit,
        max_position_embeddings: 256,
        tie_word_embeddings: false,
        attention_bias: false,
        final_logit_softcap: None,
        bos_token_id: tokenizer.specials.bos_token_id,
        eos_token_ids: tokenizer.specials.eos_token_ids.clone(),
        sliding_window: None,
        gemma3: None,
        nanochat: None,
    };
    let mut embed = vec![0.0f32; vocab * c];
    let mut head = vec![0.0f32; vocab * c];
    for (i, w) in chain.windows(2).enumerate() {
        embed[w[0] as usize * c + i] = 1.0;
        head[w[1] as usize * c + i] = 4.0;
    }
    let mut w = Weights::new("scripted-model");
    let mut put = |name: &str, shape: Vec<usize>, data: Vec<f32>| {
        w.insert(Tensor::from_f32(name, shape, data));
    };
    let p = "model.layers.0";
    put("model.embed_tokens.weight", vec![vocab, c], embed);
    put(
        &format!("{p}.input_layernorm.weight"),
        vec![c],
        vec![1.0; c],
    );
    for (name, rows) in [
        ("q_proj", heads * d),
        ("k_proj", kv * d),
        ("v_proj", kv * d),
    ] {
        put(
            &format!("{p}.self_attn.{name}.weight"),
            vec![rows, c],
            vec![0.0; rows * c],
        );
    }
    put(
        &format!("{p}.self_attn.o_proj.weight"),
        vec![c, heads * d],
        vec![0.0; c * heads * d],
    );
    put(
        &format!("{p}.post_attention_layernorm.weight"),
        vec![c],
        vec![1.0; c],
    );
    put(
        &format!("{p}.mlp.gate_proj.weight"),
        vec![f, c],
        vec![0.0; f * c],
    );
    put(
        &format!("{p}.mlp.up_proj.weight"),
        vec![f, c],
        vec![0.0; f * c],
    );
    put(
        &format!("{p}.mlp.down_proj.weight"),
        vec![c, f],
        vec![0.0; c * f],
    );
    put("model.norm.weight", vec![c], vec![1.0; c]);
    put("lm_head.weight", vec![vocab, c], head);
    let model = Model {
        path: "scripted-model".into(),
        config,
        weights: w,
        tokenizer,
        weight_type: "f32".into(),
    };
    Arc::new(
        Engine::from_model(
            model,
            kiln::engine::EngineOptions::from(kiln::backend::cpu::CpuOptions {
                threads: 1,
                ..Default::default()
            }),
        )
        .unwrap(),
    )
}

#[test]
fn nanochat_calculator_output_appears_in_the_chat_content() {
    let tok = common::nanochat_tokenizer();
    let id = |s: &str| tok.token_to_id(s).unwrap();
    let messages = [kiln::tokenizer::ChatMessage::new("user", "What is 7*6?")];
    let prompt = tok.chat_prompt(&messages).unwrap();
    let last = *prompt.last().unwrap();
    assert_eq!(last, id("<|assistant_start|>"));
    // assistant_start → python_start → 7*6 → python_end, written by the model.
    let expr = tok.encode_ordinary("7*6").unwrap();
    let mut chain = vec![last, id("<|python_start|>")];
    chain.extend(&expr);
    chain.push(id("<|python_end|>"));
    // The engine forces output_start, 42, output_end; then output_end → assistant_end.
    chain.extend([
        id("<|output_start|>"),
        id("<|output_end|>"),
        id("<|assistant_end|>"),
    ]);
    let mut sorted = chain.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), chain.len(), "the chain repeats a token");
    let e = scripted_model(&chain);
    let srv = start_on(e, |_| {});
    let want = "<|python_start|>7*6<|python_end|><|output_start|>42<|output_end|>";
    let body = json!({"messages": [{"role": "user", "content": "What is 7*6?"}],
                      "max_tokens": 30, "temperature": 0});
    let v = post(&srv, "/v1/chat/completions", &body).json();
    assert_eq!(v["choices"][0]["message"]["content"], want, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = post(&srv, "/v1/chat/completions", &streamed);
    let text: String = chunks(&r)
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(text, want);
}

/// OpenAI's penalties, written here independently: a token generated `c` times loses
/// `presence + c * frequency`.
fn reference_penalties(prompt_len: usize, presence: f32, frequency: f32) -> LogitsProcessor {
    LogitsProcessor(Arc::new(move |_, ctx: &[u32], logits: &mut [f32]| {
        for (t, l) in logits.iter_mut().enumerate() {
            let c = ctx[prompt_len..]
                .iter()
                .filter(|&&x| x as usize == t)
                .count();
            if c > 0 {
                *l -= presence + frequency * c as f32;
            }
        }
    }))
}

#[test]
fn penalties_and_sampling_extensions_are_honoured() {
    let srv = start(|_| {});
    let e = &srv.engine;
    let prompt = e.tokenizer().encode("Once upon a time").unwrap();
    let text_of = |v: Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    let lib = |opts: GenerateOptions| {
        e.generate_batch(&prompt, &opts).unwrap().rows[0]
            .text
            .clone()
    };
    let base = GenerateOptions {
        max_tokens: Some(24),
        sampling: SamplingParams::default(),
        ..GenerateOptions::default()
    };

    // Presence and frequency penalties: greedy with them equals the library with the
    // reference penalties, and differs from greedy without.
    let penalised = text_of(
        post(
            &srv,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 24, "temperature": 0,
                    "presence_penalty": 1.0, "frequency_penalty": 2.0}),
        )
        .json(),
    );
    let want = lib(GenerateOptions {
        logits_processor: Some(reference_penalties(prompt.len(), 1.0, 2.0)),
        ..base.clone()
    });
    assert_eq!(penalised, want);
    assert_ne!(
        penalised,
        lib(base.clone()),
        "the penalties changed nothing"
    );

    // top_k, min_p, repetition_penalty: a seeded sampled answer equals the library's with the
    // same parameters, and dropping any one of them changes it.
    let sampling = SamplingParams {
        temperature: 1.5,
        top_k: Some(3),
        min_p: Some(0.7),
        repetition_penalty: Some(1.5),
        seed: 5,
        ..SamplingParams::default()
    };
    let got = text_of(
        post(
            &srv,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 24, "temperature": 1.5, "top_k": 3,
                    "min_p": 0.7, "repetition_penalty": 1.5, "seed": 5}),
        )
        .json(),
    );
    let with = |s: SamplingParams| {
        lib(GenerateOptions {
            sampling: s,
            ..base.clone()
        })
    };
    assert_eq!(got, with(sampling));
    for (name, without) in [
        (
            "top_k",
            SamplingParams {
                top_k: None,
                ..sampling
            },
        ),
        (
            "min_p",
            SamplingParams {
                min_p: None,
                ..sampling
            },
        ),
        (
            "repetition_penalty",
            SamplingParams {
                repetition_penalty: None,
                ..sampling
            },
        ),
    ] {
        assert_ne!(got, with(without), "{name} changed nothing");
    }
}

#[test]
fn usage_cached_tokens_and_include_usage() {
    let srv = start(|_| {});
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(6);
    let body = json!({"prompt": long, "max_tokens": 2});
    let first = post(&srv, "/v1/completions", &body).json();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second = post(&srv, "/v1/completions", &body).json();
    let prompt_tokens = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0 && cached < prompt_tokens, "{second}");

    // Streamed without include_usage: no chunk carries usage.
    let r = post(
        &srv,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 3, "stream": true}),
    );
    for c in chunks(&r) {
        assert!(c.get("usage").is_none(), "{c}");
    }
    // With it: every chunk has usage null but the last, which has no choices. Greedy, so the
    // count is the same every run (sampled with a fresh seed, the tiny model's stop token
    // ended the stream early in 13 of 300 runs).
    let r = post(
        &srv,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 3, "stream": true, "temperature": 0,
                "stream_options": {"include_usage": true}}),
    );
    let cs = chunks(&r);
    let (last, rest) = cs.split_last().unwrap();
    assert!(rest.iter().all(|c| c["usage"].is_null()));
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 3);
}

/// With speculation on (`kiln serve --spec ngram`), greedy answers equal the library's plain
/// decoding, streamed one token per chunk with log-probabilities for every token, two choices
/// speculate side by side, and `/metrics` counts the proposals.
#[test]
fn speculative_serving_equals_plain_decoding() {
    let srv = start(|c| c.spec = Some(kiln::engine::SpecOptions::ngram(4).unwrap()));
    let e = &srv.engine;
    let text = "the cat sat on the mat. the cat sat on the mat. the cat sat on the";
    let prompt = e.tokenizer().encode(text).unwrap();
    let (want, n) = library(e, &prompt, 24, &[]);
    let body = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 1});
    let whole = post(&srv, "/v1/completions", &body).json();
    assert_eq!(whole["choices"][0]["text"], want.as_str(), "{whole}");
    let lp = whole["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap();
    assert!(lp.iter().all(Value::is_number), "{lp:?}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["n"] = json!(2);
    let r = post(&srv, "/v1/completions", &streamed);
    let mut texts = [String::new(), String::new()];
    let mut pieces = [0, 0];
    for c in chunks(&r) {
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            texts[i].push_str(ch["text"].as_str().unwrap());
            pieces[i] += ch["logprobs"]["tokens"].as_array().map_or(0, Vec::len);
        }
    }
    for (t, p) in texts.iter().zip(pieces) {
        assert_eq!(t, &want);
        assert!(p + 1 >= n, "{p} tokens streamed of {n}");
    }
    wait_until_idle(&srv);
    let proposed = metric(&srv, "kiln_spec_proposed_tokens_total");
    let accepted = metric(&srv, "kiln_spec_accepted_tokens_total");
    assert!(
        accepted > 0 && accepted <= proposed,
        "{accepted} of {proposed}"
    );
    assert!(metric(&srv, "kiln_spec_verify_passes_total") > 0);
}
