//! Speculative decoding (n-gram prompt lookup and a draft model): greedy output identical to
//! plain decoding with stop strings, the context limit and forced tool tokens in play; sampled
//! output distributed as the target's (chi-square over many seeds); drafts with another
//! vocabulary refused; and the same through the scheduler, beside other requests.

mod common;

use std::sync::Arc;

use kiln::backend::cpu::CpuOptions;
use kiln::engine::{
    BatchResult, Engine, EngineError, EngineHandle, FinishReason, GenerateOptions, LogitsProcessor,
    Request, ServeOptions, SpecError, SpecOptions,
};
use kiln::kv::{KvBudget, KvDtype, KvOptions};
use kiln::sample::SamplingParams;

fn load(name: &str) -> Arc<Engine> {
    Arc::new(
        Engine::load(
            common::fixtures().join(name),
            CpuOptions {
                threads: 2,
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

fn same_rows(plain: &BatchResult, spec: &BatchResult, what: &str) {
    same_scheduled(plain, spec, what);
    assert_eq!(plain.usage, spec.usage, "{what}: usage");
}

/// Runs `prompt` plainly and with each method on fresh sessions of `capacity`; every
/// speculative run must equal the plain one. Returns the plain result.
fn check_methods(
    target: &Arc<Engine>,
    draft: &Arc<Engine>,
    prompt: &[u32],
    capacity: usize,
    opts: &GenerateOptions,
    what: &str,
) -> BatchResult {
    let plain = target
        .session(capacity)
        .generate_batch(prompt, opts)
        .unwrap();
    for (name, spec) in [
        ("ngram", SpecOptions::ngram(4).unwrap()),
        (
            "draft",
            SpecOptions::draft(target, Arc::clone(draft), 3).unwrap(),
        ),
        (
            "fixed-length draft",
            SpecOptions {
                adaptive: false,
                ..SpecOptions::draft(target, Arc::clone(draft), 5).unwrap()
            },
        ),
    ] {
        let got = target
            .session(capacity)
            .generate_speculative(prompt, opts, &spec, |_| true)
            .unwrap();
        same_rows(&plain, &got.batch, &format!("{what}, {name}"));
        assert!(got.spec.accepted <= got.spec.proposed);
        assert!(got.spec.verify_passes <= plain.usage.completion_tokens);
    }
    plain
}

fn greedy(max_tokens: Option<usize>) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        stop_tokens: Some(Vec::new()),
        ..GenerateOptions::default()
    }
}

/// Greedy speculation equals plain decoding on tiny fixtures: to `max_tokens`, to the context
/// limit, and to a stop string taken from the middle of the plain output.
#[test]
fn greedy_speculation_equals_plain_decoding_on_fixtures() {
    let target = load("llama_tied");
    for draft_name in ["llama_untied", "llama_tied", "qwen2"] {
        let draft = load(draft_name);
        let tok = target.tokenizer();
        let prompt = tok
            .encode("the cat sat on the mat. the cat sat on the mat. the cat")
            .unwrap();
        let what = format!("draft {draft_name}");
        let plain = check_methods(&target, &draft, &prompt, 256, &greedy(Some(40)), &what);
        assert_eq!(plain.rows[0].finish_reason, FinishReason::MaxTokens);
        // The context limit, reached mid-pass.
        let limited = check_methods(
            &target,
            &draft,
            &prompt,
            prompt.len() + 13,
            &greedy(None),
            &what,
        );
        assert_eq!(limited.rows[0].finish_reason, FinishReason::ContextFull);
        // A stop string from the middle of the output.
        let text = &plain.rows[0].text;
        let chars: Vec<char> = text.chars().collect();
        let at = (2..chars.len().saturating_sub(1))
            .find(|&i| chars[i].is_ascii_alphanumeric() && chars[i + 1].is_ascii_alphanumeric())
            .unwrap_or_else(|| panic!("no ASCII pair in {text:?}"));
        let cut: String = chars[at..at + 2].iter().collect();
        let opts = GenerateOptions {
            stop_strings: vec![cut.clone()],
            ..greedy(Some(40))
        };
        let stopped = check_methods(&target, &draft, &prompt, 256, &opts, &what);
        assert_eq!(
            stopped.rows[0].finish_reason,
            FinishReason::StopString,
            "{cut:?} in {text:?}"
        );
        // A stop token: the output's tenth token.
        let opts = GenerateOptions {
            stop_tokens: Some(vec![plain.rows[0].generated[9]]),
            ..greedy(Some(40))
        };
        let stopped = check_methods(&target, &draft, &prompt, 256, &opts, &what);
        assert_eq!(stopped.rows[0].finish_reason, FinishReason::StopToken);
    }
}

/// The demo model, drafting for itself and by n-gram, on a code edit: identical greedy output,
/// and proposals are accepted (a model drafting for itself agrees with every proposal).
#[test]
fn greedy_speculation_equals_plain_decoding_on_the_demo_model() {
    let Some(path) = common::demo_model() else {
        eprintln!("demo model not fetched; skipping");
        return;
    };
    let e = Arc::new(Engine::load(&path, CpuOptions::default()).unwrap());
    let code = "fn add(a: i32, b: i32) -> i32 {\n    a + b\n}\n";
    let prompt = e
        .tokenizer()
        .encode(&format!(
            "<|im_start|>user\nRename add to sum:\n{code}<|im_end|>\n<|im_start|>assistant\n"
        ))
        .unwrap();
    let opts = GenerateOptions {
        max_tokens: Some(24),
        ..GenerateOptions::default()
    };
    let plain = e.session(512).generate_batch(&prompt, &opts).unwrap();
    for spec in [
        SpecOptions::ngram(5).unwrap(),
        SpecOptions::draft(&e, Arc::clone(&e), 4).unwrap(),
    ] {
        let got = e
            .session(512)
            .generate_speculative(&prompt, &opts, &spec, |_| true)
            .unwrap();
        same_rows(&plain, &got.batch, &format!("{:?}", spec.method));
        assert!(got.spec.accepted > 0, "{:?}: {:?}", spec.method, got.spec);
        assert!(got.batch.timings.decode_steps < plain.timings.decode_steps);
    }
}

/// Passes with nothing to verify are plain decode steps: on an engine whose decode runs through
/// the graph (here its CPU stand-in, which runs ahead and samples as the device does) their
/// tokens come from one replay of the graph, not from logits on the host. Greedy and sampled,
/// to `max_tokens` and to the context limit, by n-gram and by a draft model, every result
/// equals the host engine's speculation: tokens, text, finish reason, usage, and the pass and
/// proposal counts; greedy ones equal plain decoding too.
#[test]
fn one_token_passes_draw_through_the_decode_graph() {
    let host = load("llama_tied");
    let path = common::fixtures().join("llama_tied");
    let model = kiln::model::Model::load(&path).unwrap();
    let graph =
        Arc::new(Engine::emulating_graph_decode_on_cpu(model, CpuOptions::default()).unwrap());
    let draft = load("llama_tied.q4_0.gguf");
    let prompt = host
        .tokenizer()
        .encode("the cat sat on the mat. the dog ran to the cat. the cat")
        .unwrap();
    let sampled = GenerateOptions {
        sampling: SamplingParams {
            temperature: 1.0,
            seed: 11,
            ..SamplingParams::default()
        },
        ..greedy(Some(40))
    };
    let cases = [
        ("greedy", greedy(Some(40)), 256),
        ("sampled", sampled, 256),
        (
            "greedy to the context limit",
            greedy(None),
            prompt.len() + 13,
        ),
    ];
    for (what, opts, capacity) in cases {
        let plain = host
            .session(capacity)
            .generate_batch(&prompt, &opts)
            .unwrap();
        let mut drew = 0;
        for (method, on_host, on_graph) in [
            (
                "ngram",
                SpecOptions::ngram(4).unwrap(),
                SpecOptions::ngram(4).unwrap(),
            ),
            (
                "draft",
                SpecOptions::draft(&host, Arc::clone(&draft), 3).unwrap(),
                SpecOptions::draft(&graph, Arc::clone(&draft), 3).unwrap(),
            ),
        ] {
            let what = format!("{what}, {method}");
            let want = host
                .session(capacity)
                .generate_speculative(&prompt, &opts, &on_host, |_| true)
                .unwrap();
            let got = graph
                .session(capacity)
                .generate_speculative(&prompt, &opts, &on_graph, |_| true)
                .unwrap();
            same_rows(&want.batch, &got.batch, &what);
            if opts.sampling.temperature == 0.0 {
                same_rows(
                    &plain,
                    &got.batch,
                    &format!("{what} against plain decoding"),
                );
            }
            assert_eq!(want.spec.device_draws, 0, "{what}: the host draws no token");
            assert_eq!(
                (
                    want.spec.verify_passes,
                    want.spec.proposed,
                    want.spec.accepted
                ),
                (got.spec.verify_passes, got.spec.proposed, got.spec.accepted),
                "{what}: passes"
            );
            drew += got.spec.device_draws;
        }
        assert!(drew > 0, "{what}: no pass drew through the graph");
    }
}

/// The calculator script's generation options: 40 tokens through its processor, seed 5.
fn calculator_options(processor: &LogitsProcessor, temperature: f32) -> GenerateOptions {
    GenerateOptions {
        max_tokens: Some(40),
        logits_processor: Some(processor.clone()),
        sampling: SamplingParams {
            temperature,
            seed: 5,
            ..SamplingParams::default()
        },
        ..GenerateOptions::default()
    }
}

/// Tool use under speculation: the calculator's output is forced (mask 0) exactly where plain
/// decoding forces it, whether the proposals guessed it or not. The model's choices are
/// scripted by a logits processor; the prompt already holds the call, so n-gram lookup
/// proposes the expression, the call's end and the forced output.
/// A nanochat-tokenizer model whose logits processor writes `<|python_start|>12*3<|python_end|>`
/// twice (the calculator forces its output after each), then `<|assistant_end|>`; and the
/// prompt (a chat turn that shows the same call once) it runs on.
fn calculator_script() -> (Arc<Engine>, Vec<u32>, LogitsProcessor) {
    let tok = common::nanochat_tokenizer();
    let e = common::uniform_model_with(tok, 2);
    let tok = e.tokenizer();
    let id = |s: &str| tok.token_to_id(s).unwrap();
    let (ps, pe, ae) = (
        id("<|python_start|>"),
        id("<|python_end|>"),
        id("<|assistant_end|>"),
    );
    let script = tok.encode_ordinary("12*3").unwrap();
    let mut prompt = vec![id("<|bos|>"), id("<|user_start|>")];
    prompt.extend(
        tok.encode("<|python_start|>12*3<|python_end|><|output_start|>36<|output_end|>")
            .unwrap(),
    );
    prompt.extend([id("<|user_end|>"), id("<|assistant_start|>")]);
    let plen = prompt.len();
    // Twice: python_start, the expression, python_end; then (after the forced output) end.
    let processor = LogitsProcessor(Arc::new(move |_, ctx: &[u32], logits: &mut [f32]| {
        let out = &ctx[plen..];
        let calls = out.iter().filter(|&&t| t == ps).count();
        let want = match out.iter().rposition(|&t| t == ps) {
            None => ps,
            Some(at) => {
                let written = out.len() - at - 1;
                if written < script.len() {
                    script[written]
                } else if written == script.len() {
                    pe
                } else if calls < 2 {
                    ps
                } else {
                    ae
                }
            }
        };
        logits.iter_mut().for_each(|l| *l = f32::NEG_INFINITY);
        logits[want as usize] = 0.0;
    }));
    (e, prompt, processor)
}

#[test]
fn forced_tool_tokens_under_speculation() {
    let (e, prompt, processor) = calculator_script();
    let tok = e.tokenizer();
    let ae = tok.token_to_id("<|assistant_end|>").unwrap();
    let plen = prompt.len();
    for temperature in [0.0, 1.0] {
        let opts = calculator_options(&processor, temperature);
        let plain = check_methods(&e, &e, &prompt, 256, &opts, &format!("T={temperature}"));
        let row = &plain.rows[0];
        assert_eq!(row.finish_reason, FinishReason::StopToken);
        let forced = 2 + tok.encode_ordinary("36").unwrap().len();
        assert_eq!(
            row.masks.iter().filter(|&&m| m == 0).count() - plen,
            2 * forced
        );
        assert_eq!(row.generated.last(), Some(&ae));
        let spec = e
            .session(256)
            .generate_speculative(&prompt, &opts, &SpecOptions::ngram(6).unwrap(), |_| true)
            .unwrap();
        assert!(spec.spec.accepted >= 4, "{:?}", spec.spec);
    }
}

/// Top-3 probabilities of `logits` at temperature 1, as (id, p).
fn top3(logits: &[f32]) -> Vec<(u32, f64)> {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
    ids.truncate(3);
    let m = logits[ids[0] as usize] as f64;
    let w: Vec<f64> = ids
        .iter()
        .map(|&i| (logits[i as usize] as f64 - m).exp())
        .collect();
    let total: f64 = w.iter().sum();
    ids.into_iter()
        .zip(w.into_iter().map(|x| x / total))
        .collect()
}

/// Sampled speculation keeps the target's distribution. The first generated token is fixed by
/// a logits processor; the next two are sampled (temperature 1, top-k 3) in one verification
/// pass, from proposals by a different model (llama_tied's q4_0 quantization drafting for its
/// f32 weights) and by
/// n-gram lookup. Over 3000 seeds, the pair's frequencies are checked against the target's
/// own probabilities with Pearson's chi-square (8 degrees of freedom; P(χ² > 26.12) = 0.001).
/// The draws are keyed by seed and position, so the statistic is the same on every run.
#[test]
fn sampled_speculation_keeps_the_target_distribution() {
    let target = load("llama_tied");
    // The same weights quantized: close to the target, but not equal.
    let draft = load("llama_tied.q4_0.gguf");
    let tok = target.tokenizer();
    let mut prompt = tok.encode("the cat sat on the mat and the dog").unwrap();
    let first = tok.encode(" sat").unwrap()[0];
    // Make n-gram lookup propose two tokens after `first`: the prompt's last token and
    // `first` occur earlier, followed twice by a token `a` in the target's top 3 there.
    let last = *prompt.last().unwrap();
    let top3_after = |prompt: &[u32]| {
        let mut ctx = prompt.to_vec();
        ctx.push(first);
        top3(target.session(128).feed(&ctx).unwrap())
    };
    let a = (0..tok.vocab_size() as u32)
        .find(|&a| {
            let mut p = vec![last, first, a, a];
            p.extend(&prompt);
            top3_after(&p).iter().any(|&(t, _)| t == a)
        })
        .expect("some token is in the top 3 after it is proposed");
    prompt.splice(0..0, [last, first, a, a]);
    let plen = prompt.len();
    let processor = LogitsProcessor(Arc::new(move |_, ctx: &[u32], logits: &mut [f32]| {
        if ctx.len() == plen {
            logits.iter_mut().for_each(|l| *l = f32::NEG_INFINITY);
            logits[first as usize] = 0.0;
        }
    }));
    // The target's distribution of the pair after prompt + first.
    let mut expected: Vec<((u32, u32), f64)> = Vec::new();
    let mut ctx = prompt.clone();
    ctx.push(first);
    let mut s = target.session(128);
    for (t1, p1) in top3(s.feed(&ctx).unwrap()) {
        let mut ctx2 = ctx.clone();
        ctx2.push(t1);
        let mut s2 = target.session(128);
        for (t2, p2) in top3(s2.feed(&ctx2).unwrap()) {
            expected.push(((t1, t2), p1 * p2));
        }
    }
    let n = 3000u64;
    for (name, spec) in [
        (
            "draft",
            SpecOptions::draft(&target, Arc::clone(&draft), 2).unwrap(),
        ),
        ("ngram", SpecOptions::ngram(2).unwrap()),
    ] {
        let mut counts = vec![0usize; expected.len()];
        let (mut proposed, mut accepted) = (0, 0);
        let mut session = target.session(128);
        for seed in 0..n {
            let opts = GenerateOptions {
                max_tokens: Some(4),
                stop_tokens: Some(Vec::new()),
                logits_processor: Some(processor.clone()),
                sampling: SamplingParams {
                    temperature: 1.0,
                    top_k: Some(3),
                    seed,
                    ..SamplingParams::default()
                },
                ..GenerateOptions::default()
            };
            let r = session
                .generate_speculative(&prompt, &opts, &spec, |_| true)
                .unwrap();
            let g = &r.batch.rows[0].generated;
            assert_eq!(g[0], first);
            let cell = expected
                .iter()
                .position(|(pair, _)| *pair == (g[1], g[2]))
                .unwrap_or_else(|| panic!("{name}: {g:?} is outside the target's top 3"));
            counts[cell] += 1;
            proposed += r.spec.proposed;
            accepted += r.spec.accepted;
        }
        let chi: f64 = counts
            .iter()
            .zip(&expected)
            .map(|(&c, (_, p))| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum();
        assert!(
            chi < 26.12,
            "{name}: χ² = {chi:.2}; counts {counts:?}, expected {expected:?}"
        );
        // Both branches of the rule ran.
        assert!(
            accepted > 0 && accepted < proposed,
            "{name}: {accepted}/{proposed}"
        );
    }
}

/// A draft with another vocabulary is refused, naming both models; so is a draft length of 0
/// and more than one sample row.
#[test]
fn mismatched_drafts_and_bad_options_are_refused() {
    let target = load("llama_tied");
    let other = load("nanochat_H");
    match SpecOptions::draft(&target, Arc::clone(&other), 4) {
        Err(e @ SpecError::DraftVocabulary { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("nanochat_H") && msg.contains("llama_tied"),
                "{msg}"
            );
        }
        other => panic!("expected a vocabulary refusal, got {other:?}"),
    }
    assert!(matches!(SpecOptions::ngram(0), Err(SpecError::MaxDraft)));
    let opts = GenerateOptions {
        num_samples: 2,
        ..GenerateOptions::default()
    };
    let spec = SpecOptions::ngram(3).unwrap();
    let err = target
        .session(64)
        .generate_speculative(&[1, 2, 3], &opts, &spec, |_| true)
        .unwrap_err();
    assert!(
        matches!(err, EngineError::Spec(SpecError::Samples(2))),
        "{err}"
    );
    // Options built field by field reach the scheduler unchecked: it checks them itself.
    let handle = EngineHandle::start(Arc::clone(&target), ServeOptions::default()).unwrap();
    for (spec, what) in [
        (
            SpecOptions {
                max_draft: 0,
                ..SpecOptions::ngram(3).unwrap()
            },
            "max_draft",
        ),
        (
            SpecOptions {
                method: kiln::engine::SpecMethod::Draft(Arc::clone(&other)),
                ..SpecOptions::ngram(3).unwrap()
            },
            "nanochat_H",
        ),
    ] {
        let Err(err) = handle.submit(Request {
            prompt: vec![1, 2, 3],
            options: GenerateOptions::default(),
            spec: Some(spec),
        }) else {
            panic!("{what}: accepted");
        };
        assert!(err.to_string().contains(what), "{err}");
    }
}

fn kiln(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .unwrap()
}

/// `kiln --spec ngram|draft` reproduces transformers' greedy tokens and reports the
/// speculation in its JSON; bad flag combinations and a foreign draft fail naming the flag.
#[test]
fn cli_speculation_reproduces_the_reference_and_refuses_bad_flags() {
    let r = common::Reference::load(&common::fixtures().join("llama_tied/reference.safetensors"));
    let ids: Vec<String> = r.prompt_ids.iter().map(u32::to_string).collect();
    let ids = ids.join(",");
    let model = common::fixtures().join("llama_tied");
    let model = model.to_str().unwrap();
    let draft = common::fixtures().join("llama_tied.q4_0.gguf");
    let draft = draft.to_str().unwrap();
    let base = [
        "-m",
        model,
        "--prompt-ids",
        &ids,
        "-n",
        "17",
        "--ignore-eos",
        "--json",
    ];
    for extra in [
        vec!["--spec", "ngram"],
        vec!["--spec", "draft", "--draft", draft, "--draft-max", "3"],
    ] {
        let out = kiln(&[&base[..], &extra].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{extra:?}: {stderr}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let got: Vec<u32> = v["generated_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(got, r.generated_ids, "{extra:?}");
        let spec = &v["spec"];
        assert!(
            spec["verify_passes"].as_u64().unwrap() <= 16,
            "{extra:?}: {spec}"
        );
        assert!(spec["accepted"].as_u64() <= spec["proposed"].as_u64());
    }
    let nanochat = common::fixtures().join("nanochat_H");
    for (extra, want) in [
        (vec!["--spec", "draft"], "--spec draft needs --draft MODEL"),
        (
            vec!["--draft", draft],
            "--draft is only used with --spec draft",
        ),
        (
            vec!["--spec", "ngram", "--draft-max", "0"],
            "--draft-max must be at least 1",
        ),
        (
            vec!["--spec", "ngram", "--samples", "2"],
            "--spec runs one sample row",
        ),
        (
            vec!["--spec", "draft", "--draft", nanochat.to_str().unwrap()],
            "cannot draft for",
        ),
    ] {
        let out = kiln(&[&base[..], &extra].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} succeeded");
        assert!(stderr.contains(want), "{extra:?}: {stderr}");
    }
}

/// `kiln-bench --spec` measures both methods against plain decoding (the run fails if their
/// outputs differ) and prints one table row per model and thread count.
#[test]
fn bench_compares_speculation_with_plain_decoding() {
    let model = common::fixtures().join("llama_tied");
    let draft = common::fixtures().join("llama_tied.q4_0.gguf");
    for (extra, method) in [
        (vec!["--spec", "ngram"], "| ngram (k ≤ 4) |"),
        (
            vec![
                "--spec",
                "draft",
                "--draft",
                draft.to_str().unwrap(),
                "--draft-max",
                "2",
            ],
            "llama_tied.q4_0.gguf (k ≤ 2) |",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
            .args([
                "-m",
                model.to_str().unwrap(),
                "-n",
                "12",
                "-r",
                "1",
                "-t",
                "1",
            ])
            .args(&extra)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let row = stdout
            .lines()
            .find(|l| l.contains(method))
            .unwrap_or_else(|| panic!("{extra:?}: no row in {stdout}"));
        assert!(row.ends_with("× |"), "{row}");
    }
}

/// A constraint under greedy speculation: proposals it forbids are rejected, and the output,
/// its end and its finish reason equal plain decoding's.
#[test]
fn constrained_greedy_speculation_equals_plain_decoding() {
    let target = load("llama_tied");
    let draft = load("llama_tied.q4_0.gguf");
    let prompt = target
        .tokenizer()
        .encode("the cat sat on the mat. the cat sat on the mat. the cat")
        .unwrap();
    for rx in [
        "( (the|cat|sat|on|mat))+\\.",
        "( (the|cat|sat|on|mat)){1,6}\\.",
    ] {
        let opts = GenerateOptions {
            constraint: Some(kiln::engine::ConstraintSpec::Regex(rx.into())),
            ..greedy(Some(30))
        };
        let plain = check_methods(&target, &draft, &prompt, 256, &opts, rx);
        assert_eq!(
            plain.rows[0].finish_reason,
            FinishReason::ConstraintEnd,
            "{rx}"
        );
    }
}

/// Runs `reqs` through one engine handle (submitted together, so they join the scheduler's
/// steps at different points) and returns each request's rows and speculation statistics.
fn scheduled(
    e: &Arc<Engine>,
    reqs: &[Request],
    opts: ServeOptions,
) -> (Vec<BatchResult>, kiln::engine::SchedulerStats) {
    let handle = EngineHandle::start(Arc::clone(e), opts).unwrap();
    let pending: Vec<_> = reqs
        .iter()
        .map(|r| handle.submit(r.clone()).unwrap())
        .collect();
    let results = pending.into_iter().map(|h| h.wait().unwrap()).collect();
    // The scheduler publishes its counters after the step that sent the last event.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let stats = handle.stats();
        if stats.running == 0 && stats.waiting == 0 {
            return (results, stats);
        }
        assert!(std::time::Instant::now() < deadline, "{stats:?}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Rows drafted by the same model share its passes: per scheduler step the draft runs at most
/// `max_draft` forward passes (every row's catch-up, then one per proposal position) whatever
/// the number of rows, where drafting row by row would run that many per row. The tokens stay
/// plain decoding's, also when `spec_step_rows` trims or stops the proposals.
#[test]
fn scheduled_drafts_run_one_pass_per_position_for_every_row() {
    let e = load("llama_tied");
    let near = load("llama_tied.q4_0.gguf");
    let tok = e.tokenizer();
    let base = tok
        .encode("the cat sat on the mat. the dog sat on the cat. the cat sat on the")
        .unwrap();
    let spec = SpecOptions {
        adaptive: false,
        ..SpecOptions::draft(&e, Arc::clone(&near), 3).unwrap()
    };
    let reqs: Vec<Request> = (0..6)
        .map(|i| Request {
            prompt: base[i..].to_vec(),
            options: greedy(Some(24)),
            spec: Some(spec.clone()),
        })
        .collect();
    let unlimited = ServeOptions {
        spec_step_rows: usize::MAX,
        ..ServeOptions::default()
    };
    let (got, stats) = scheduled(&e, &reqs, unlimited);
    let alone: Vec<BatchResult> = reqs
        .iter()
        .map(|r| e.generate_batch(&r.prompt, &r.options).unwrap())
        .collect();
    for (i, (a, g)) in alone.iter().zip(&got).enumerate() {
        same_scheduled(a, g, &format!("request {i}"));
    }
    assert!(stats.spec_accepted_tokens > 0, "{stats:?}");
    assert!(
        stats.spec_draft_passes > 0 && stats.spec_draft_passes <= 3 * stats.steps,
        "more than max_draft draft passes per step: {stats:?}"
    );
    assert!(
        stats.spec_verify_passes >= 2 * stats.steps,
        "the rows did not run together: {stats:?}"
    );

    // `spec_step_rows` caps a step's rows with proposals: 0 turns speculation off, and one
    // row under a cap of 3 proposes at most 2 tokens a pass.
    let off = ServeOptions {
        spec_step_rows: 0,
        ..ServeOptions::default()
    };
    let (got, stats) = scheduled(&e, &reqs, off);
    for (i, (a, g)) in alone.iter().zip(&got).enumerate() {
        same_scheduled(a, g, &format!("off, request {i}"));
    }
    assert_eq!(
        (stats.spec_proposed_tokens, stats.spec_draft_passes),
        (0, 0),
        "{stats:?}"
    );
    let three = ServeOptions {
        spec_step_rows: 3,
        ..ServeOptions::default()
    };
    let (got, stats) = scheduled(&e, &reqs[..1], three);
    same_scheduled(&alone[0], &got[0], "capped at 3 rows");
    assert!(
        stats.spec_proposed_tokens > 0
            && stats.spec_proposed_tokens <= 2 * stats.spec_verify_passes,
        "{stats:?}"
    );
}

/// Row by row: tokens, masks, text and finish reason, and the completion count.
fn same_scheduled(alone: &BatchResult, got: &BatchResult, what: &str) {
    assert_eq!(alone.rows.len(), got.rows.len(), "{what}: rows");
    for (a, g) in alone.rows.iter().zip(&got.rows) {
        assert_eq!(a.generated, g.generated, "{what}: tokens");
        assert_eq!(a.masks, g.masks, "{what}: masks");
        assert_eq!(a.text, g.text, "{what}: text");
        assert_eq!(a.finish_reason, g.finish_reason, "{what}: finish reason");
    }
    assert_eq!(
        alone.usage.completion_tokens, got.usage.completion_tokens,
        "{what}: completion tokens"
    );
}

/// Requests with speculation (n-gram, a draft model that mostly agrees, the target drafting
/// for itself) beside plain ones, greedy and sampled, with stop strings and tokens, a regex
/// constraint, two samples, the context limit and a joining long prompt, through one
/// scheduler. With a pool too small for all of them (preemption) and a tight step budget
/// (trimmed proposals), every greedy row equals plain decoding alone; with room for all and
/// a wide budget, every row equals its session run (`generate_speculative` for sampled ones).
#[test]
fn scheduled_speculation_equals_decoding_alone() {
    let e = load("llama_tied");
    let near = load("llama_tied.q4_0.gguf");
    let tok = e.tokenizer();
    let text = "the cat sat on the mat. the cat sat on the mat. the dog sat on the cat. the";
    let base = tok.encode(text).unwrap();
    let methods = [
        None,
        Some(SpecOptions::ngram(4).unwrap()),
        Some(SpecOptions::draft(&e, Arc::clone(&near), 3).unwrap()),
        Some(SpecOptions {
            adaptive: false,
            ..SpecOptions::draft(&e, Arc::clone(&e), 5).unwrap()
        }),
    ];
    let mut reqs = Vec::new();
    for i in 0..24usize {
        let prompt = base[i % 7..].to_vec();
        let mut options = match i % 6 {
            0 | 1 => greedy(Some(12 + i)),
            2 => GenerateOptions {
                stop_strings: vec![" mat".into()],
                ..greedy(Some(40))
            },
            3 => GenerateOptions {
                constraint: Some(kiln::engine::ConstraintSpec::Regex(
                    "( (the|cat|sat|on|mat))+\\.".into(),
                )),
                ..greedy(Some(30))
            },
            4 => GenerateOptions {
                max_tokens: Some(30),
                stop_tokens: Some(Vec::new()),
                sampling: SamplingParams {
                    temperature: 0.9,
                    top_k: Some(40),
                    seed: i as u64,
                    ..SamplingParams::default()
                },
                ..GenerateOptions::default()
            },
            _ => GenerateOptions {
                num_samples: 2,
                ..greedy(Some(20))
            },
        };
        if i == 7 {
            // A stop token from the middle of what plain decoding writes.
            let plain = e.generate_batch(&prompt, &greedy(Some(20))).unwrap();
            options.stop_tokens = Some(vec![plain.rows[0].generated[8]]);
        }
        reqs.push(Request {
            prompt,
            options,
            spec: methods[i % 4].clone(),
        });
    }
    // To the context limit, through proposals.
    let ctx = e.max_context();
    let long: Vec<u32> = base.iter().cycle().take(ctx - 11).copied().collect();
    reqs.push(Request {
        prompt: long,
        options: greedy(None),
        spec: Some(SpecOptions::ngram(6).unwrap()),
    });

    let alone: Vec<BatchResult> = reqs
        .iter()
        .map(|r| match (&r.spec, r.options.sampling.temperature > 0.0) {
            (Some(spec), true) => {
                e.session(ctx)
                    .generate_speculative(&r.prompt, &r.options, spec, |_| true)
                    .unwrap()
                    .batch
            }
            _ => e.generate_batch(&r.prompt, &r.options).unwrap(),
        })
        .collect();
    assert_eq!(
        alone.last().unwrap().rows[0].finish_reason,
        FinishReason::ContextFull
    );
    assert_eq!(alone[7].rows[0].finish_reason, FinishReason::StopToken);

    // Tight: 4-position blocks, a pool for a fraction of the requests, 24 tokens a step.
    let tight = ServeOptions {
        kv_budget: KvBudget::Blocks(ctx / 4 + 40),
        kv: KvOptions {
            block_size: 4,
            dtype: KvDtype::F32,
        },
        max_running: 64,
        max_step_tokens: 24,
        prefix_cache: true,
        spec_step_rows: usize::MAX,
    };
    let (got, stats) = scheduled(&e, &reqs, tight);
    assert!(stats.preemptions > 0, "the pool never ran short: {stats:?}");
    assert!(
        stats.spec_accepted_tokens > 0 && stats.spec_proposed_tokens > stats.spec_accepted_tokens,
        "{stats:?}"
    );
    assert_eq!(stats.blocks_free + stats.prefix_blocks, stats.blocks_total);
    for (i, (a, g)) in alone.iter().zip(&got).enumerate() {
        if reqs[i].options.sampling.temperature == 0.0 {
            same_scheduled(a, g, &format!("tight, request {i}"));
        } else {
            // Preemption recomputes a row and trimmed budgets propose less: the draws differ
            // from the session's, the distribution does not.
            assert_eq!(g.usage.completion_tokens, 30, "tight, request {i}");
        }
    }

    let roomy = ServeOptions {
        kv_budget: KvBudget::Bytes(256 << 20),
        max_step_tokens: 4096,
        ..tight
    };
    let (got, stats) = scheduled(&e, &reqs, roomy);
    assert_eq!(stats.preemptions, 0);
    for (i, (a, g)) in alone.iter().zip(&got).enumerate() {
        same_scheduled(a, g, &format!("roomy, request {i}"));
    }
    println!("{stats:?}");
}

/// Forced tool tokens are proposed as they are (not counted as guesses) and the rows still
/// equal their session runs, greedy and sampled.
#[test]
fn scheduled_speculation_with_forced_tool_tokens() {
    let (e, prompt, processor) = calculator_script();
    let spec = SpecOptions::ngram(6).unwrap();
    let reqs: Vec<Request> = [0.0, 1.0]
        .into_iter()
        .map(|temperature| Request {
            prompt: prompt.clone(),
            options: calculator_options(&processor, temperature),
            spec: Some(spec.clone()),
        })
        .collect();
    let (got, stats) = scheduled(&e, &reqs, ServeOptions::default());
    for (r, g) in reqs.iter().zip(&got) {
        let alone = e
            .session(256)
            .generate_speculative(&r.prompt, &r.options, &spec, |_| true)
            .unwrap();
        same_scheduled(&alone.batch, g, "forced tool tokens");
        assert_eq!(g.rows[0].finish_reason, FinishReason::StopToken);
        assert!(g.rows[0].masks.contains(&0));
    }
    assert!(stats.spec_accepted_tokens >= 8, "{stats:?}");
}
