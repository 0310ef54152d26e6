//! The engine's pipelined decode (the path the CUDA megakernel's graph takes) against the
//! plain host path, on the CPU: `Engine::emulating_graph_decode_on_cpu` swaps the graph decoder
//! for a CPU stand-in that runs up to 8 steps ahead of the engine exactly as the device does
//! (cache written past the confirmed lengths, tokens sampled ahead, everything in flight dropped
//! when the host must take over). Every result must equal the host path's: tokens, masks, text,
//! finish reasons, and the session's state afterwards.

mod common;

use std::sync::Arc;

use common::fixtures;
use kiln::backend::cpu::CpuOptions;
use kiln::engine::{BatchResult, Engine, GenerateOptions, LogitsProcessor, Session};
use kiln::model::Model;
use kiln::sample::SamplingParams;

fn engines(fixture: &str) -> (Arc<Engine>, Arc<Engine>) {
    let path = fixtures().join(fixture);
    let host = Engine::load(&path, CpuOptions::default()).unwrap();
    let model = Model::load(&path).unwrap();
    let graph = Engine::emulating_graph_decode_on_cpu(model, CpuOptions::default()).unwrap();
    assert!(graph.uses_megakernel() && !host.uses_megakernel());
    (Arc::new(host), Arc::new(graph))
}

fn same(a: &BatchResult, b: &BatchResult, what: &str) {
    assert_eq!(a.rows.len(), b.rows.len(), "{what}");
    for (i, (x, y)) in a.rows.iter().zip(&b.rows).enumerate() {
        assert_eq!(x.generated, y.generated, "{what}: row {i} tokens");
        assert_eq!(x.tokens, y.tokens, "{what}: row {i} sequence");
        assert_eq!(x.masks, y.masks, "{what}: row {i} masks");
        assert_eq!(x.text, y.text, "{what}: row {i} text");
        assert_eq!(x.finish_reason, y.finish_reason, "{what}: row {i} finish");
    }
    assert_eq!(a.usage, b.usage, "{what}: usage");
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: Some(20),
        top_p: Some(0.9),
        seed,
        ..SamplingParams::default()
    }
}

const PROMPT: [u32; 4] = [1, 17, 42, 99];

#[test]
fn greedy_and_sampled_rows_match_the_host_path() {
    for fixture in ["llama_tied", "qwen2", "nanochat_H"] {
        let (host, graph) = engines(fixture);
        for (n, samples, sampling) in [
            (3, 1, SamplingParams::default()),
            (40, 1, SamplingParams::default()),
            (30, 3, sampled(7)),
            (25, 8, sampled(11)),
        ] {
            let opts = GenerateOptions {
                max_tokens: Some(n),
                num_samples: samples,
                sampling,
                stop_tokens: Some(vec![]),
                ..GenerateOptions::default()
            };
            let what = format!("{fixture}: {n} tokens x {samples} rows");
            same(
                &host.generate_batch(&PROMPT, &opts).unwrap(),
                &graph.generate_batch(&PROMPT, &opts).unwrap(),
                &what,
            );
        }
    }
}

#[test]
fn a_full_cache_stops_the_graph_at_the_same_token() {
    let (host, graph) = engines("llama_tied");
    let opts = GenerateOptions {
        max_tokens: None,
        num_samples: 2,
        sampling: sampled(3),
        stop_tokens: Some(vec![]),
        ..GenerateOptions::default()
    };
    // 20 positions: the prompt and 16 more; the graph must not run past the cache.
    let mut a = Session::new(Arc::clone(&host), 20, 2);
    let mut b = Session::new(Arc::clone(&graph), 20, 2);
    same(
        &a.generate_batch(&PROMPT, &opts).unwrap(),
        &b.generate_batch(&PROMPT, &opts).unwrap(),
        "context full",
    );
}

#[test]
fn stop_strings_and_stop_tokens_end_rows_as_on_the_host() {
    let (host, graph) = engines("llama_tied");
    let base = GenerateOptions {
        max_tokens: Some(40),
        num_samples: 3,
        sampling: sampled(5),
        stop_tokens: Some(vec![]),
        ..GenerateOptions::default()
    };
    let free = host.generate_batch(&PROMPT, &base).unwrap();
    // A stop string from the middle of row 1's text, and row 2's 10th token as a stop token.
    let text = &free.rows[1].text;
    let cut: String = text
        .chars()
        .skip(text.chars().count() / 2)
        .take(3)
        .collect();
    let opts = GenerateOptions {
        stop_strings: vec![cut],
        stop_tokens: Some(vec![free.rows[2].generated[9]]),
        ..base
    };
    same(
        &host.generate_batch(&PROMPT, &opts).unwrap(),
        &graph.generate_batch(&PROMPT, &opts).unwrap(),
        "stop rules",
    );
}

#[test]
fn forced_tool_tokens_leave_the_graph_and_come_back() {
    let host = Arc::new(
        Engine::from_model(
            common::uniform_model_of(common::nanochat_tokenizer()),
            CpuOptions::default(),
        )
        .unwrap(),
    );
    let graph = Arc::new(
        Engine::emulating_graph_decode_on_cpu(
            common::uniform_model_of(common::nanochat_tokenizer()),
            CpuOptions::default(),
        )
        .unwrap(),
    );
    let tok = host.tokenizer();
    let id = |s: &str| tok.token_to_id(s).unwrap();
    let (ps, pe, ae) = (
        id("<|python_start|>"),
        id("<|python_end|>"),
        id("<|assistant_end|>"),
    );
    let scripts: Vec<Vec<u32>> = ["12*3", "'strawberry'.count('r')", "7+8"]
        .iter()
        .map(|x| tok.encode_ordinary(x).unwrap())
        .collect();
    let prompt = vec![
        id("<|bos|>"),
        id("<|user_start|>"),
        50,
        id("<|assistant_start|>"),
    ];
    let plen = prompt.len();
    // Per row: a few free tokens, a tool call, a few more, a second call, then the end.
    let processor = LogitsProcessor(Arc::new(move |row: usize, ctx: &[u32], l: &mut [f32]| {
        let out = &ctx[plen..];
        let calls = out.iter().filter(|&&t| t == pe).count();
        let since = out.iter().rposition(|&t| t == ps || t == pe);
        let want = match since.map(|i| (out[i], out.len() - i - 1)) {
            _ if calls == 2 && out.len() > 40 => Some(ae),
            Some((t, n)) if t == ps && n < scripts[row].len() => Some(scripts[row][n]),
            Some((t, n)) if t == ps && n == scripts[row].len() => Some(pe),
            None if out.len() == 3 + row => Some(ps),
            Some((t, n)) if t == pe && calls == 1 && n == 6 + row => Some(ps),
            _ => None,
        };
        if let Some(w) = want {
            l.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
            l[w as usize] = 0.0;
        }
    }));
    let opts = GenerateOptions {
        num_samples: 3,
        max_tokens: Some(60),
        sampling: sampled(9),
        logits_processor: Some(processor),
        stop_tokens: None,
        ..GenerateOptions::default()
    };
    let a = host.generate_batch(&prompt, &opts).unwrap();
    let b = graph.generate_batch(&prompt, &opts).unwrap();
    let forced = a
        .rows
        .iter()
        .map(|r| r.masks.iter().filter(|&&m| m == 0).count());
    assert!(
        forced.clone().all(|n| n > plen + 4),
        "every row must take forced tool output twice: {:?}",
        forced.collect::<Vec<_>>()
    );
    same(&a, &b, "tool calls");
}

#[test]
fn a_session_continues_exactly_after_a_graph_stream() {
    let (host, graph) = engines("nanochat_H");
    let opts = GenerateOptions {
        max_tokens: Some(12),
        sampling: sampled(2),
        stop_tokens: Some(vec![]),
        ..GenerateOptions::default()
    };
    let mut a = Session::new(Arc::clone(&host), 128, 1);
    let mut b = Session::new(Arc::clone(&graph), 128, 1);
    let mut prompt = PROMPT.to_vec();
    for turn in 0..3 {
        let ra = a.generate_batch(&prompt, &opts).unwrap();
        let rb = b.generate_batch(&prompt, &opts).unwrap();
        same(&ra, &rb, &format!("turn {turn}"));
        assert_eq!(a.tokens(), b.tokens(), "turn {turn}: cached tokens");
        assert_eq!(a.logits(), b.logits(), "turn {turn}: last logits");
        prompt = ra.rows[0].tokens.clone();
        prompt.extend([5, 6, 7]);
    }
    // Dropping a stream mid-way drops what ran ahead; both caches hold what was emitted.
    for (s, what) in [(&mut a, "host"), (&mut b, "graph")] {
        let mut st = s.stream(&prompt, &opts).unwrap();
        let mut want = prompt.clone();
        for _ in 0..3 {
            want.extend(st.next().unwrap().unwrap().tokens().into_iter().flatten());
        }
        drop(st);
        assert_eq!(
            s.tokens(),
            &want[..],
            "{what}: cached after dropping the stream"
        );
    }
    assert_eq!(
        a.feed(&[9]).unwrap(),
        b.feed(&[9]).unwrap(),
        "logits after the drop"
    );
}
