//! The engine's generation contract (nanochat's `Engine`, spec §5–§6): ported from nanochat's
//! `tests/test_engine.py` against a uniform-logits model, plus every option kiln adds, checked
//! on real fixture models where a behaviour needs real text.

mod common;

use std::sync::Arc;

use common::{fixtures, uniform_model, Reference};
use kiln::backend::cpu::CpuOptions;
use kiln::engine::{Engine, FinishReason, GenerateOptions, Session};
use kiln::sample::SamplingParams;

fn sampled(seed: u64) -> GenerateOptions {
    GenerateOptions {
        max_tokens: Some(20),
        sampling: SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::default()
        },
        stop_tokens: Some(vec![]),
        ..GenerateOptions::default()
    }
}

const PROMPT: [u32; 5] = [1, 40, 50, 60, 70];

/// test_engine.py: test_multi_sample_first_token_diversity — with uniform logits, 16 rows must
/// not all start with the same token (nanochat once sampled the first token once for all rows).
#[test]
fn first_token_is_sampled_independently_per_row() {
    let e = uniform_model(2);
    let opts = GenerateOptions {
        num_samples: 16,
        max_tokens: Some(1),
        ..sampled(42)
    };
    let r = e.generate_batch(&PROMPT, &opts).unwrap();
    assert_eq!(r.rows.len(), 16);
    let first: std::collections::HashSet<u32> = r.rows.iter().map(|row| row.generated[0]).collect();
    assert!(first.len() > 1, "all 16 rows started with the same token");
}

/// test_seed_reproducibility / test_different_seeds_introduce_variation
#[test]
fn seeds_reproduce_and_differ() {
    let e = uniform_model(2);
    let a = e.generate_batch(&PROMPT, &sampled(42)).unwrap();
    let b = e.generate_batch(&PROMPT, &sampled(42)).unwrap();
    assert_eq!(a.rows[0].generated, b.rows[0].generated);
    let outs: std::collections::HashSet<Vec<u32>> = (0..5)
        .map(|s| {
            e.generate_batch(&PROMPT, &sampled(s)).unwrap().rows[0]
                .generated
                .clone()
        })
        .collect();
    assert!(outs.len() > 1, "five seeds gave one output");
}

/// Same seed, same tokens, whatever the thread count.
#[test]
fn seeded_output_is_independent_of_thread_count() {
    let opts = GenerateOptions {
        num_samples: 3,
        ..sampled(7)
    };
    let one = uniform_model(1).generate_batch(&PROMPT, &opts).unwrap();
    let two = uniform_model(2).generate_batch(&PROMPT, &opts).unwrap();
    for (a, b) in one.rows.iter().zip(&two.rows) {
        assert_eq!(a.generated, b.generated);
    }
}

/// test_temperature_zero_determinism: greedy ignores the seed.
#[test]
fn temperature_zero_is_greedy_and_ignores_the_seed() {
    let e = uniform_model(2);
    let greedy = |seed| GenerateOptions {
        sampling: SamplingParams {
            temperature: 0.0,
            seed,
            ..SamplingParams::default()
        },
        ..sampled(seed)
    };
    let a = e.generate_batch(&PROMPT, &greedy(1)).unwrap();
    let b = e.generate_batch(&PROMPT, &greedy(2)).unwrap();
    assert_eq!(a.rows[0].generated, b.rows[0].generated);
    // Uniform logits: argmax is the first index on ties.
    assert!(a.rows[0].generated.iter().all(|&t| t == 0));
}

/// test_max_tokens_respected and test_num_samples_count; nanochat's generate_batch layout:
/// prompt + generated, masks 0 for the prompt and 1 for sampled tokens.
#[test]
fn max_tokens_num_samples_and_batch_layout() {
    let e = uniform_model(2);
    for max in [0, 1, 5, 13] {
        let opts = GenerateOptions {
            max_tokens: Some(max),
            num_samples: 4,
            ..sampled(3)
        };
        let r = e.generate_batch(&PROMPT, &opts).unwrap();
        assert_eq!(r.rows.len(), 4);
        for row in &r.rows {
            assert_eq!(row.generated.len(), max);
            assert_eq!(row.finish_reason, FinishReason::MaxTokens);
            assert_eq!(&row.tokens[..PROMPT.len()], &PROMPT);
            assert_eq!(row.tokens.len(), PROMPT.len() + max);
            assert_eq!(row.masks.len(), row.tokens.len());
            assert!(row.masks[..PROMPT.len()].iter().all(|&m| m == 0));
            assert!(row.masks[PROMPT.len()..].iter().all(|&m| m == 1));
        }
        assert_eq!(r.usage.prompt_tokens, PROMPT.len());
        assert_eq!(r.usage.completion_tokens, 4 * max);
    }
}

/// Streaming yields one column per step, and each row stops at its own end: a finished row
/// reports its terminal token once, then `None`. The terminal token is not in `tokens`.
#[test]
fn rows_stop_independently_and_terminal_tokens_are_dropped_from_batches() {
    let e = uniform_model(2);
    // Half the vocabulary stops a row: rows end at different steps.
    let stop: Vec<u32> = (0..200).collect();
    let opts = GenerateOptions {
        num_samples: 8,
        max_tokens: Some(30),
        stop_tokens: Some(stop.clone()),
        ..sampled(11)
    };
    let mut session = Session::new(e.clone(), PROMPT.len() + 30, 8);
    let mut ended_at = vec![None; 8];
    let mut stream = session.stream(&PROMPT, &opts).unwrap();
    for (steps, step) in stream.by_ref().enumerate() {
        let step = step.unwrap();
        assert_eq!(step.rows.len(), 8);
        for (r, row) in step.rows.iter().enumerate() {
            match (row, ended_at[r]) {
                (Some(_), Some(_)) => panic!("row {r} stepped after finishing"),
                (None, None) => panic!("row {r} skipped a step before finishing"),
                (Some(row), None) if row.finished.is_some() => {
                    assert_eq!(row.finished, Some(FinishReason::StopToken));
                    assert!(stop.contains(&row.token));
                    ended_at[r] = Some(steps);
                }
                _ => {}
            }
        }
    }
    let distinct: std::collections::HashSet<_> = ended_at.iter().collect();
    assert!(distinct.len() > 1, "all rows ended together: {ended_at:?}");
    let r = Session::new(e.clone(), PROMPT.len() + 30, 8)
        .generate_batch(&PROMPT, &opts)
        .unwrap();
    for row in &r.rows {
        assert_eq!(row.finish_reason, FinishReason::StopToken);
        let last = *row.generated.last().unwrap();
        assert!(stop.contains(&last));
        assert_eq!(row.tokens.len(), PROMPT.len() + row.generated.len() - 1);
        assert!(!stop.contains(row.tokens.last().unwrap()) || row.generated.len() == 1);
    }
}

/// The default stop set holds the model's EOS and BOS, as nanochat stops on assistant_end/bos.
#[test]
fn default_stop_tokens_include_eos_and_bos() {
    let e = uniform_model(1);
    let stops = e.default_stop_tokens();
    assert!(stops.contains(&2) && stops.contains(&1), "{stops:?}");
}

/// The cache is never written past its capacity: generation ends with ContextFull.
#[test]
fn a_full_cache_ends_generation_cleanly() {
    let e = uniform_model(2);
    let opts = GenerateOptions {
        max_tokens: None,
        num_samples: 2,
        ..sampled(5)
    };
    let mut s = Session::new(e.clone(), 12, 2);
    let r = s.generate_batch(&PROMPT, &opts).unwrap();
    for row in &r.rows {
        assert_eq!(row.finish_reason, FinishReason::ContextFull);
        // 12 positions: 5 prompt + 7 fed generated tokens, and one more sampled from the last logits.
        assert_eq!(row.generated.len(), 12 - PROMPT.len() + 1);
    }
    let long: Vec<u32> = (0..13).collect();
    assert!(s.generate_batch(&long, &opts).is_err());
}

/// Stop strings end a row with the text before the match, across token boundaries; checked on
/// the llama fixture's known greedy continuation.
#[test]
fn stop_strings_cut_text_before_the_match() {
    let e = Arc::new(Engine::load(fixtures().join("llama_tied"), CpuOptions::default()).unwrap());
    let r = Reference::load(&fixtures().join("llama_tied/reference.safetensors"));
    let tok = e.tokenizer();
    let full = tok.decode(&r.generated_ids).unwrap();
    // A two-character ASCII stop string straddling a token boundary, first occurring there.
    let stop = (1..r.generated_ids.len())
        .find_map(|i| {
            let at = tok.decode(&r.generated_ids[..i]).unwrap().len();
            let w = full.get(at.checked_sub(1)?..at + 1)?;
            (w.is_ascii() && full.find(w) == Some(at - 1)).then(|| w.to_string())
        })
        .expect("no ASCII token boundary in the fixture's continuation");
    let expected = &full[..full.find(&stop).unwrap()];
    let opts = GenerateOptions {
        max_tokens: Some(17),
        stop_tokens: Some(vec![]),
        stop_strings: vec![stop.clone()],
        ..GenerateOptions::default()
    };
    let out = e.generate_batch(&r.prompt_ids, &opts).unwrap();
    assert_eq!(
        out.rows[0].finish_reason,
        FinishReason::StopString,
        "stop {stop:?} in {full:?}"
    );
    assert_eq!(out.rows[0].text, expected);
    assert_eq!(
        &out.rows[0].generated[..],
        &r.generated_ids[..out.rows[0].generated.len()]
    );
}

/// Options: top-k 1 is greedy, top-p tiny is greedy, min-p 1 is greedy (on real logits), and a
/// strong repetition penalty changes a greedy continuation that repeats.
#[test]
fn sampling_filters_reduce_to_greedy_at_their_limits() {
    let e = Arc::new(Engine::load(fixtures().join("llama_tied"), CpuOptions::default()).unwrap());
    let r = Reference::load(&fixtures().join("llama_tied/reference.safetensors"));
    let run = |sampling: SamplingParams| {
        let opts = GenerateOptions {
            max_tokens: Some(17),
            stop_tokens: Some(vec![]),
            sampling,
            ..GenerateOptions::default()
        };
        e.generate_batch(&r.prompt_ids, &opts).unwrap().rows[0]
            .generated
            .clone()
    };
    let hot = SamplingParams {
        temperature: 1.5,
        seed: 9,
        ..SamplingParams::default()
    };
    assert_eq!(
        run(SamplingParams {
            top_k: Some(1),
            ..hot
        }),
        r.generated_ids
    );
    assert_eq!(
        run(SamplingParams {
            top_p: Some(1e-6),
            ..hot
        }),
        r.generated_ids
    );
    assert_eq!(
        run(SamplingParams {
            min_p: Some(1.0),
            ..hot
        }),
        r.generated_ids
    );
    assert_ne!(
        run(hot),
        r.generated_ids,
        "temperature 1.5 reproduced greedy exactly"
    );
    let penalized = run(SamplingParams {
        repetition_penalty: Some(100.0),
        ..SamplingParams::default()
    });
    let distinct: std::collections::HashSet<_> = penalized.iter().collect();
    assert_eq!(
        distinct.len(),
        penalized.len(),
        "a 100x penalty still repeated a token: {penalized:?}"
    );
}

/// Eight sessions generating at once over one engine give exactly their serial results.
#[test]
fn concurrent_sessions_match_serial_results() {
    let e = Arc::new(
        Engine::load(
            fixtures().join("llama_bias"),
            CpuOptions {
                threads: 2,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let prompt = |i: u32| -> Vec<u32> { (0..6 + i).map(|j| (j * 37 + i * 11) % 390 + 3).collect() };
    let opts = |i: u64| GenerateOptions {
        num_samples: 2,
        ..sampled(i)
    };
    let serial: Vec<_> = (0..8u32)
        .map(|i| e.generate_batch(&prompt(i), &opts(i as u64)).unwrap().rows)
        .collect();
    let handles: Vec<_> = (0..8u32)
        .map(|i| {
            let e = e.clone();
            std::thread::spawn(move || e.generate_batch(&prompt(i), &opts(i as u64)).unwrap().rows)
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let rows = h.join().unwrap();
        for (a, b) in rows.iter().zip(&serial[i]) {
            assert_eq!(a.generated, b.generated, "session {i}");
        }
    }
}

/// A second chat turn reuses the cached conversation: only the new tokens are prefilled, and
/// the result equals a fresh session's.
#[test]
fn multi_turn_sessions_reuse_the_cache() {
    let e = Arc::new(Engine::load(fixtures().join("llama_tied"), CpuOptions::default()).unwrap());
    let opts = GenerateOptions {
        max_tokens: Some(6),
        stop_tokens: Some(vec![]),
        ..GenerateOptions::default()
    };
    let mut s = e.session(200);
    let turn1: Vec<u32> = vec![1, 100, 120, 140, 2];
    let r1 = s.generate_batch(&turn1, &opts).unwrap();
    assert_eq!(r1.timings.prefill_tokens, turn1.len());
    let mut turn2 = r1.rows[0].tokens.clone();
    turn2.extend_from_slice(&[2, 1, 150, 160, 2]);
    let r2 = s.generate_batch(&turn2, &opts).unwrap();
    // Everything but the last generated token (never fed) was already cached.
    assert_eq!(r2.timings.prefill_tokens, 6);
    let fresh = e.session(200).generate_batch(&turn2, &opts).unwrap();
    assert_eq!(r2.rows[0].generated, fresh.rows[0].generated);
    assert_eq!(fresh.timings.prefill_tokens, turn2.len());
}

/// Tool use (spec §6): a row that writes `<|python_start|>expr<|python_end|>` gets
/// `<|output_start|>result<|output_end|>` forced after it with mask 0, fed to the model, and
/// rows are independent. The model's choices are scripted with a logits processor.
#[test]
fn calculator_results_are_forced_into_each_row() {
    use kiln::engine::LogitsProcessor;
    let tok = common::nanochat_tokenizer();
    let e = common::uniform_model_with(tok, 2);
    let tok = e.tokenizer();
    let id = |s: &str| tok.token_to_id(s).unwrap();
    let (ps, pe, os, oe, ae) = (
        id("<|python_start|>"),
        id("<|python_end|>"),
        id("<|output_start|>"),
        id("<|output_end|>"),
        id("<|assistant_end|>"),
    );
    let exprs = ["12*3", "'strawberry'.count('r')", "1/0"];
    let scripts: Vec<Vec<u32>> = exprs
        .iter()
        .map(|x| tok.encode_ordinary(x).unwrap())
        .collect();
    let prompt: Vec<u32> = vec![
        id("<|bos|>"),
        id("<|user_start|>"),
        50,
        id("<|user_end|>"),
        id("<|assistant_start|>"),
    ];
    let plen = prompt.len();
    let script = scripts.clone();
    // Per row: python_start, the expression, python_end, then (after any forced output) end.
    let processor = LogitsProcessor(Arc::new(
        move |row: usize, ctx: &[u32], logits: &mut [f32]| {
            let out = &ctx[plen..];
            let want = match out.iter().position(|&t| t == ps) {
                None => ps,
                Some(at) => {
                    let written = out.len() - at - 1;
                    if written < script[row].len() {
                        script[row][written]
                    } else if written == script[row].len() {
                        pe
                    } else {
                        ae
                    }
                }
            };
            logits.iter_mut().for_each(|l| *l = f32::NEG_INFINITY);
            logits[want as usize] = 0.0;
        },
    ));
    let opts = GenerateOptions {
        num_samples: 3,
        max_tokens: Some(40),
        logits_processor: Some(processor),
        ..sampled(1)
    };
    let stop = e.default_stop_tokens();
    assert!(stop.contains(&ae));
    let r = e
        .generate_batch(
            &prompt,
            &GenerateOptions {
                stop_tokens: None,
                ..opts
            },
        )
        .unwrap();
    for (row, (expr, result)) in r.rows.iter().zip([
        ("12*3", Some("36")),
        ("'strawberry'.count('r')", Some("3")),
        ("1/0", None),
    ]) {
        let mut want = vec![ps];
        want.extend(tok.encode_ordinary(expr).unwrap());
        want.push(pe);
        let mut masks = vec![1u8; want.len()];
        if let Some(res) = result {
            let forced: Vec<u32> = [vec![os], tok.encode_ordinary(res).unwrap(), vec![oe]].concat();
            masks.extend(std::iter::repeat_n(0u8, forced.len()));
            want.extend(forced);
        }
        want.push(ae);
        masks.push(1);
        assert_eq!(row.generated, want, "{expr}");
        assert_eq!(
            &row.masks[plen..],
            &masks[..masks.len() - 1],
            "{expr}: masks (terminal dropped)"
        );
        assert_eq!(row.finish_reason, FinishReason::StopToken);
        let shown = match result {
            Some(res) => {
                format!("<|python_start|>{expr}<|python_end|><|output_start|>{res}<|output_end|>")
            }
            None => format!("<|python_start|>{expr}<|python_end|>"),
        };
        assert_eq!(row.text, shown);
    }
    // Without tools the same script gets no forced output.
    let processor = LogitsProcessor(Arc::new(|_, _, l: &mut [f32]| {
        l.iter_mut().for_each(|x| *x = 0.0)
    }));
    let plain = e
        .generate_batch(
            &prompt,
            &GenerateOptions {
                tools: false,
                max_tokens: Some(5),
                logits_processor: Some(processor),
                ..sampled(1)
            },
        )
        .unwrap();
    assert!(plain.rows[0].masks.iter().all(|&m| m <= 1));
}

/// Services share one engine across threads and move sessions between them.
#[test]
fn engine_is_send_and_sync_and_sessions_are_send() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Engine>();
    send::<Session>();
}

/// Log-probabilities on request: a session's stream and the scheduler give every row's every
/// token the same numbers (the model's raw log-softmax, not the sampling distribution), and
/// requests that do not ask get none.
#[test]
fn logprobs_from_a_session_equal_the_schedulers() {
    use kiln::engine::{EngineHandle, Event, Request, ServeOptions};
    let e = Arc::new(Engine::load(fixtures().join("llama_tied"), CpuOptions::default()).unwrap());
    let prompt = e.tokenizer().encode("Once upon a time").unwrap();
    let opts = GenerateOptions {
        num_samples: 2,
        max_tokens: Some(8),
        logprobs: Some(3),
        ..sampled(4)
    };
    let mut session_rows: Vec<Vec<(u32, kiln::engine::TokenLogprobs)>> = vec![Vec::new(); 2];
    let mut s = Session::new(Arc::clone(&e), 200, 2);
    for step in s.stream(&prompt, &opts).unwrap() {
        for (r, row) in step.unwrap().rows.into_iter().enumerate() {
            if let Some(row) = row {
                session_rows[r].push((row.token, row.logprobs.expect("asked for")));
            }
        }
    }
    let handle = EngineHandle::start(Arc::clone(&e), ServeOptions::default()).unwrap();
    let mut sched_rows: Vec<Vec<(u32, kiln::engine::TokenLogprobs)>> = vec![Vec::new(); 2];
    for event in handle
        .submit(Request {
            prompt: prompt.clone(),
            options: opts.clone(),
            spec: None,
        })
        .unwrap()
    {
        if let Event::Step(step) = event {
            for (r, row) in step.rows.into_iter().enumerate() {
                if let Some(row) = row {
                    sched_rows[r].push((row.token, row.logprobs.expect("asked for")));
                }
            }
        }
    }
    for (a, b) in session_rows.iter().zip(&sched_rows) {
        assert_eq!(a.len(), b.len());
        for ((ta, la), (tb, lb)) in a.iter().zip(b) {
            assert_eq!(ta, tb);
            assert!((la.logprob - lb.logprob).abs() < 1e-4, "{la:?} {lb:?}");
            assert_eq!(la.top.len(), 3);
            for ((ia, pa), (ib, pb)) in la.top.iter().zip(&lb.top) {
                assert_eq!(ia, ib);
                assert!((pa - pb).abs() < 1e-4);
            }
            // The top entries are in order and the taken token is no likelier than the first.
            assert!(la.top.windows(2).all(|w| w[0].1 >= w[1].1));
            assert!(la.logprob <= la.top[0].1 + 1e-6);
        }
    }
    let plain = Session::new(Arc::clone(&e), 200, 2)
        .stream(
            &prompt,
            &GenerateOptions {
                logprobs: None,
                ..opts
            },
        )
        .unwrap()
        .map(|s| s.unwrap())
        .collect::<Vec<_>>();
    assert!(plain
        .iter()
        .flat_map(|s| &s.rows)
        .flatten()
        .all(|r| r.logprobs.is_none()));
}
