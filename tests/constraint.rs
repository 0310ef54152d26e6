//! Constrained decoding: token masks checked against independent references (a regex DFA from
//! the `regex-automata` crate, llguidance's own token validation), forced tool tokens advancing
//! the constraint, finish reasons, and the demo model's constrained output parsed and validated.

mod common;

use std::sync::Arc;

use kiln::engine::constraint::JSON_WHITESPACE;
use kiln::engine::{
    Constraint, ConstraintFactory, ConstraintSpec, Engine, EngineHandle, FinishReason,
    GenerateOptions, LogitsProcessor, Request, ServeOptions,
};
use kiln::sample::SamplingParams;
use kiln::tokenizer::{ChatMessage, TokenBytes, Tokenizer};
use regex_automata::dfa::{dense, Automaton};
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};
use serde_json::{json, Value};

/// A small deterministic generator for the random walks (no RNG crate needed).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

fn allowed_ids(c: &mut Constraint, vocab: usize) -> Vec<u32> {
    let mask = c.allowed().unwrap();
    (0..vocab as u32).filter(|&t| mask.is_allowed(t)).collect()
}

/// The token bytes agree with the `tokenizers` crate's decoding: a token whose bytes are valid
/// UTF-8 decodes to them, special tokens decode to their names, and any text's tokens
/// concatenate to its bytes (multi-byte characters split across tokens included).
#[test]
fn token_bytes_agree_with_the_tokenizers_decoding() {
    let mut toks = vec![common::nanochat_tokenizer()];
    if let Some(p) = common::demo_model() {
        toks.push(kiln::model::Model::load(&p).unwrap().tokenizer);
    } else {
        println!(
            "SKIPPED the demo model's vocabulary: models/SmolLM2-135M-Instruct.Q4_1.gguf is absent"
        );
    }
    for tok in &toks {
        let bytes = tok.token_bytes().unwrap();
        assert_eq!(bytes.len(), tok.vocab_size());
        let mut partial = 0;
        for (id, t) in bytes.iter().enumerate() {
            let text = tok.decode(&[id as u32]).unwrap();
            match std::str::from_utf8(&t.bytes) {
                Ok(s) => assert_eq!(s, text, "token {id}"),
                Err(_) => partial += 1,
            }
        }
        // Byte-level vocabularies have tokens that are parts of a UTF-8 character.
        assert!(partial >= 64, "{partial} partial-character tokens");
        for text in [
            "héllo wörld",
            "日本語のテキスト",
            "emoji 🙂🚀 end",
            "tabs\tand\nlines",
        ] {
            let ids = tok.encode_ordinary(text).unwrap();
            let joined: Vec<u8> = ids
                .iter()
                .flat_map(|&i| bytes[i as usize].bytes.clone())
                .collect();
            assert_eq!(joined, text.as_bytes(), "{text}");
        }
    }
    let tok = &toks[0];
    let bytes = tok.token_bytes().unwrap();
    let ps = tok.token_to_id("<|python_start|>").unwrap();
    assert_eq!(
        bytes[ps as usize],
        TokenBytes {
            bytes: b"<|python_start|>".to_vec(),
            special: true
        }
    );
}

/// An anchored DFA for a regex, matching the whole text (every match kept: no leftmost-first
/// pruning of alternatives).
struct Dfa {
    dfa: dense::DFA<Vec<u32>>,
    start: StateID,
    /// Whether a state can still reach a whole-text match, per state seen.
    live: std::cell::RefCell<std::collections::HashMap<StateID, bool>>,
}

impl Dfa {
    fn new(rx: &str) -> Dfa {
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .match_kind(MatchKind::All)
                    .minimize(true),
            )
            .build(rx)
            .unwrap();
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .unwrap();
        Dfa {
            dfa,
            start,
            live: Default::default(),
        }
    }

    fn run(&self, bytes: &[u8]) -> StateID {
        bytes
            .iter()
            .fold(self.start, |s, &b| self.dfa.next_state(s, b))
    }

    /// Whether some text that starts with `bytes` matches. (Not just "the state is not dead":
    /// the DFA reports a match one byte late, so the state one byte past a match that nothing
    /// extends is not dead yet.)
    fn viable(&self, bytes: &[u8]) -> bool {
        let s = self.run(bytes);
        if let Some(&known) = self.live.borrow().get(&s) {
            return known;
        }
        let mut seen = std::collections::HashSet::from([s]);
        let mut todo = vec![s];
        let mut live = false;
        while let Some(t) = todo.pop() {
            if self.dfa.is_match_state(self.dfa.next_eoi_state(t)) {
                live = true;
                break;
            }
            for b in 0..=255u8 {
                let n = self.dfa.next_state(t, b);
                if !self.dfa.is_dead_state(n) && seen.insert(n) {
                    todo.push(n);
                }
            }
        }
        self.live.borrow_mut().insert(s, live);
        live
    }

    /// Whether `bytes` matches.
    fn matches(&self, bytes: &[u8]) -> bool {
        let s = self.dfa.next_eoi_state(self.run(bytes));
        self.dfa.is_match_state(s)
    }
}

/// On random walks through a regex constraint (each step picks an allowed token at random),
/// the mask allows exactly the tokens whose bytes keep the text a prefix of a match, per an
/// independent DFA, and the end-of-sequence token exactly when the text is a match. Special
/// tokens are never text. A row that ends is a match nothing extends.
#[test]
fn regex_masks_agree_with_a_dfa_on_random_walks() {
    let tok = common::nanochat_tokenizer();
    let bytes = tok.token_bytes().unwrap();
    let vocab = tok.vocab_size();
    let eos = tok.token_to_id("<|assistant_end|>").unwrap();
    let factory = ConstraintFactory::for_tokenizer(&tok, vocab, &[eos]).unwrap();
    let regexes = [
        r"(yes|no|maybe), (the )?[a-z]{2,6}( [a-z]+){0,3}\.",
        r"[0-9]{1,3}(\.[0-9]{1,2})? (°C|°F|K)",
        r"(ab|abc)*d?",
        r"[A-Z][a-z]*( [A-Z][a-z]*)*: [^\n]{0,12}\n",
    ];
    let mut rng = Lcg(7);
    for rx in regexes {
        let dfa = Dfa::new(rx);
        let root = Constraint::new(&factory, &ConstraintSpec::Regex(rx.to_string())).unwrap();
        for walk in 0..12 {
            let mut c = root.fork();
            let mut text: Vec<u8> = Vec::new();
            for _ in 0..40 {
                let allowed = allowed_ids(&mut c, vocab);
                for id in 0..vocab as u32 {
                    let t = &bytes[id as usize];
                    let want = if id == eos {
                        dfa.matches(&text)
                    } else if t.special || t.bytes.is_empty() {
                        false
                    } else {
                        dfa.viable(&[text.as_slice(), &t.bytes].concat())
                    };
                    assert_eq!(
                        allowed.contains(&id),
                        want,
                        "{rx} walk {walk}: token {id} {:?} after {:?}",
                        String::from_utf8_lossy(&t.bytes),
                        String::from_utf8_lossy(&text)
                    );
                }
                let pick = allowed[rng.below(allowed.len())];
                let done = c.commit(pick).unwrap();
                if pick == eos {
                    assert!(done, "{rx}: end of sequence ends the constraint");
                    break;
                }
                text.extend_from_slice(&bytes[pick as usize].bytes);
                if done {
                    assert!(dfa.matches(&text), "{rx}: ended on {text:?}");
                    assert!(
                        (0..=255u8).all(|b| !dfa.viable(&[text.as_slice(), &[b]].concat())),
                        "{rx}: ended on {text:?}, which can be extended"
                    );
                    break;
                }
            }
        }
    }
}

/// llguidance's token trie over the same vocabulary, built here independently of kiln's factory.
fn reference_matcher(tok: &Tokenizer, eos: u32, schema: &Value) -> llguidance::Matcher {
    use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
    let words: Vec<Vec<u8>> = tok
        .token_bytes()
        .unwrap()
        .into_iter()
        .map(|t| {
            if t.special {
                [&[0xff][..], &t.bytes].concat()
            } else {
                t.bytes
            }
        })
        .collect();
    let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, eos), &words);
    let env: toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    let mut f = llguidance::ParserFactory::new_simple(&env).unwrap();
    f.quiet();
    let grammar = llguidance::api::TopLevelGrammar::from_json_schema(schema.clone());
    llguidance::Matcher::new(f.create_parser(grammar))
}

/// On random walks through a JSON-schema constraint, every token the mask allows is one
/// llguidance's parser accepts when fed token by token (its validation path, not its mask
/// computation), and every token it forbids is refused.
#[test]
fn json_schema_masks_agree_with_token_validation_on_random_walks() {
    let tok = common::nanochat_tokenizer();
    let vocab = tok.vocab_size();
    let eos = tok.token_to_id("<|assistant_end|>").unwrap();
    let factory = ConstraintFactory::for_tokenizer(&tok, vocab, &[eos]).unwrap();
    let schema = json!({
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tag": {"enum": ["red", "green", "blue"]},
            "note": {"type": "string", "maxLength": 6},
            "xs": {"type": "array", "items": {"type": "number"}, "maxItems": 2}
        },
        "required": ["id", "tag"],
        "additionalProperties": false
    });
    let root = Constraint::new(&factory, &ConstraintSpec::JsonSchema(schema.clone())).unwrap();
    // What kiln compiles by default: the schema with bounded whitespace.
    let mut effective = schema.clone();
    effective["x-guidance"] = json!({ "whitespace_pattern": JSON_WHITESPACE });
    let bytes = tok.token_bytes().unwrap();
    let mut rng = Lcg(11);
    let mut longest_space = 0;
    for walk in 0..6 {
        let mut c = root.fork();
        let mut reference = reference_matcher(&tok, eos, &effective);
        let mut text = Vec::new();
        for step in 0..30 {
            let allowed = allowed_ids(&mut c, vocab);
            for id in 0..vocab as u32 {
                if id == eos {
                    continue;
                }
                let valid = reference.validate_tokens(&[id]).unwrap() == 1;
                assert_eq!(
                    allowed.contains(&id),
                    valid,
                    "walk {walk} step {step}: token {id}"
                );
            }
            assert_eq!(
                allowed.contains(&eos),
                reference.is_accepting().unwrap(),
                "walk {walk} step {step}: end of sequence"
            );
            let pick = allowed[rng.below(allowed.len())];
            let done = c.commit(pick).unwrap();
            reference.consume_token(pick).unwrap();
            text.extend_from_slice(&bytes[pick as usize].bytes);
            if done {
                break;
            }
        }
        let runs = text.split(|b| !b" \t\n\r".contains(b));
        longest_space = longest_space.max(runs.map(<[u8]>::len).max().unwrap_or(0));
    }
    // Whitespace runs are bounded (strings here hold at most 6 characters).
    assert!(
        longest_space <= 22,
        "{longest_space} whitespace bytes in a row"
    );
    assert!(
        longest_space >= 2,
        "the walks never used the whitespace they may"
    );
}

/// A byte-level tokenizer with only the tokens given (ids in order) and an end token.
fn tiny_tokenizer(tokens: &[&str]) -> Tokenizer {
    let mut vocab = serde_json::Map::new();
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert(t.to_string(), json!(i));
    }
    let end = tokens.len();
    vocab.insert("<|end|>".into(), json!(end));
    let doc = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": end, "content": "<|end|>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    });
    Tokenizer::from_json(
        &serde_json::to_vec(&doc).unwrap(),
        std::path::Path::new("tiny"),
        kiln::tokenizer::SpecialTokens {
            eos_token_ids: vec![end as u32],
            ..Default::default()
        },
    )
    .unwrap()
}

fn sampled(seed: u64, max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: Some(max_tokens),
        sampling: SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::default()
        },
        ..GenerateOptions::default()
    }
}

/// A constraint that completes ends its row with `ConstraintEnd`, one that is complete but may
/// go on lets the row stop on its end token, and one that no token can continue ends the row
/// with `ConstraintBroken` without emitting anything more. Rows of a batch are independent.
#[test]
fn finish_reasons_follow_the_constraint() {
    let tok = tiny_tokenizer(&["a", "b", "d", "ab"]);
    let e = common::uniform_model_with(tok, 1);
    let (a, b, d, ab, end) = (0u32, 1, 2, 3, 4);
    let run = |rx: &str, samples: usize| {
        e.generate_batch(
            &[a],
            &GenerateOptions {
                num_samples: samples,
                constraint: Some(ConstraintSpec::Regex(rx.into())),
                ..sampled(3, 20)
            },
        )
        .unwrap()
    };
    // "abd" is complete and nothing may follow.
    let r = run("abd", 4);
    for row in &r.rows {
        assert_eq!(row.finish_reason, FinishReason::ConstraintEnd);
        assert!(
            row.generated == [a, b, d] || row.generated == [ab, d],
            "{:?}",
            row.generated
        );
        assert_eq!(row.text, "abd");
    }
    // "a+" is complete after any a; the row ends when it samples the end token (dropped from
    // `tokens`, kept in `generated`), or at max_tokens.
    let r = run("a+", 8);
    let mut stopped = 0;
    for row in &r.rows {
        let n = row.generated.len();
        match row.finish_reason {
            FinishReason::StopToken => {
                stopped += 1;
                assert_eq!(row.generated[n - 1], end);
                assert!(n >= 2 && row.generated[..n - 1].iter().all(|&t| t == a));
            }
            FinishReason::MaxTokens => assert!(row.generated.iter().all(|&t| t == a)),
            other => panic!("{other:?}"),
        }
    }
    assert!(
        stopped > 0,
        "the end token is allowed once the text matches"
    );
    // No token spells "c": after "ab" nothing continues "abc".
    let r = run("abc", 3);
    for row in &r.rows {
        assert_eq!(row.finish_reason, FinishReason::ConstraintBroken);
        assert!(
            row.generated == [a, b] || row.generated == [ab],
            "{:?}",
            row.generated
        );
    }
    // A bad regex is refused before anything runs, naming what it is.
    let err = e
        .generate_batch(
            &[a],
            &GenerateOptions {
                constraint: Some(ConstraintSpec::Regex("a(".into())),
                ..sampled(3, 20)
            },
        )
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("regex: "), "{err}");
}

/// Tool output forced into a row (mask 0) advances its constraint like sampled tokens: a
/// grammar that requires the calculator's result after the call and "!" after that is
/// satisfied, and one that requires another result ends the row with `ConstraintBroken` at
/// the first forced token it refuses. The model's choices are scripted only inside the call.
#[test]
fn forced_tool_tokens_advance_the_constraint() {
    let tok = common::nanochat_tokenizer();
    let e = common::uniform_model_with(tok, 1);
    let tok = e.tokenizer();
    let id = |s: &str| tok.token_to_id(s).unwrap();
    let (ps, pe, os, oe) = (
        id("<|python_start|>"),
        id("<|python_end|>"),
        id("<|output_start|>"),
        id("<|output_end|>"),
    );
    let expr = tok.encode_ordinary("12*3").unwrap();
    let script = expr.clone();
    // Inside the call the expression is scripted; elsewhere logits stay uniform.
    let processor = LogitsProcessor(Arc::new(move |_, ctx: &[u32], logits: &mut [f32]| {
        if let Some(at) = ctx.iter().rposition(|&t| t == ps) {
            let written = ctx.len() - at - 1;
            if !ctx[at..].contains(&pe) {
                let want = script.get(written).copied().unwrap_or(pe);
                logits.iter_mut().for_each(|l| *l = f32::NEG_INFINITY);
                logits[want as usize] = 0.0;
            }
        }
    }));
    let prompt = [id("<|bos|>"), id("<|user_start|>"), 50, id("<|user_end|>")];
    let run = |result: &str| {
        let grammar = format!(
            "start: \"x=\" <|python_start|> EXPR <|python_end|> <|output_start|> {result} \
             <|output_end|> \"!\"\nEXPR: /[0-9]+\\*[0-9]+/\n"
        );
        e.generate_batch(
            &prompt,
            &GenerateOptions {
                num_samples: 2,
                logits_processor: Some(processor.clone()),
                constraint: Some(ConstraintSpec::Lark(grammar)),
                ..sampled(5, 40)
            },
        )
        .unwrap()
    };
    let forced: Vec<u32> = [vec![os], tok.encode_ordinary("36").unwrap(), vec![oe]].concat();
    let r = run("/[0-9]+/");
    for row in &r.rows {
        assert_eq!(row.finish_reason, FinishReason::ConstraintEnd, "{row:?}");
        assert_eq!(
            row.text,
            "x=<|python_start|>12*3<|python_end|><|output_start|>36<|output_end|>!"
        );
        let at = row.generated.iter().position(|&t| t == ps).unwrap();
        let call: Vec<u32> = [vec![ps], expr.clone(), vec![pe], forced.clone()].concat();
        assert_eq!(row.generated[at..at + call.len()], call[..]);
        let masks = &row.masks[prompt.len() + at + 2 + expr.len()..];
        assert_eq!(masks[..forced.len()], vec![0u8; forced.len()][..]);
        assert_eq!(masks[forced.len()..], [1u8]);
    }
    let r = run("\"99\"");
    for row in &r.rows {
        assert_eq!(row.finish_reason, FinishReason::ConstraintBroken, "{row:?}");
        let n = row.generated.len();
        assert_eq!(row.generated[n - 2..], [os, forced[1]]);
    }
}

/// A subset of JSON Schema validation, enough for the schemas below: types, enums, bounds,
/// string lengths and patterns, array sizes, required and additional properties, anyOf.
fn validate(v: &Value, s: &Value, path: &str) -> Result<(), String> {
    let fail = |what: &str| Err(format!("{path}: {what} ({v})"));
    if let Some(options) = s["anyOf"].as_array() {
        return match options.iter().any(|o| validate(v, o, path).is_ok()) {
            true => Ok(()),
            false => fail("matches no anyOf option"),
        };
    }
    if let Some(options) = s["enum"].as_array() {
        if !options.contains(v) {
            return fail("not in the enum");
        }
    }
    match s["type"].as_str() {
        Some("object") => {
            let Some(o) = v.as_object() else {
                return fail("not an object");
            };
            let props = s["properties"].as_object().cloned().unwrap_or_default();
            for r in s["required"].as_array().into_iter().flatten() {
                if !o.contains_key(r.as_str().unwrap()) {
                    return fail(&format!("misses required {r}"));
                }
            }
            for (k, x) in o {
                match props.get(k) {
                    Some(p) => validate(x, p, &format!("{path}.{k}"))?,
                    None if s["additionalProperties"] == json!(false) => {
                        return fail(&format!("has extra property {k}"))
                    }
                    None => {}
                }
            }
        }
        Some("array") => {
            let Some(a) = v.as_array() else {
                return fail("not an array");
            };
            if s["minItems"].as_u64().is_some_and(|m| (a.len() as u64) < m)
                || s["maxItems"].as_u64().is_some_and(|m| a.len() as u64 > m)
            {
                return fail("has the wrong number of items");
            }
            for (i, x) in a.iter().enumerate() {
                validate(x, &s["items"], &format!("{path}[{i}]"))?;
            }
        }
        Some("string") => {
            let Some(t) = v.as_str() else {
                return fail("not a string");
            };
            let n = t.chars().count() as u64;
            if s["minLength"].as_u64().is_some_and(|m| n < m)
                || s["maxLength"].as_u64().is_some_and(|m| n > m)
            {
                return fail("has the wrong length");
            }
            if let Some(p) = s["pattern"].as_str() {
                if !regex::Regex::new(p).unwrap().is_match(t) {
                    return fail("does not match its pattern");
                }
            }
        }
        Some(t @ ("integer" | "number")) => {
            let Some(x) = v.as_f64() else {
                return fail("not a number");
            };
            if t == "integer" && !(v.is_i64() || v.is_u64()) {
                return fail("not an integer");
            }
            if s["minimum"].as_f64().is_some_and(|m| x < m)
                || s["maximum"].as_f64().is_some_and(|m| x > m)
            {
                return fail("is out of range");
            }
        }
        Some("boolean") if !v.is_boolean() => return fail("not a boolean"),
        _ => {}
    }
    Ok(())
}

fn demo() -> Option<Arc<Engine>> {
    let Some(path) = common::demo_model() else {
        println!("SKIPPED: models/SmolLM2-135M-Instruct.Q4_1.gguf is absent");
        return None;
    };
    let opts = kiln::backend::cpu::CpuOptions::default();
    Some(Arc::new(Engine::load(path, opts).unwrap()))
}

/// The demo model on an engine that emulates the device (the decode graph and the device's
/// masked draws, stood in for on the host). Call after [`demo`] found the model.
fn demo_on_a_device_stand_in() -> Arc<Engine> {
    let path = common::demo_model().expect("demo() found it");
    Arc::new(
        Engine::emulating_graph_decode_on_cpu(
            kiln::model::Model::load(&path).unwrap(),
            kiln::backend::cpu::CpuOptions::default(),
        )
        .unwrap(),
    )
}

fn chat(e: &Engine, text: &str) -> Vec<u32> {
    e.tokenizer()
        .chat_prompt(&[ChatMessage::new("user", text)])
        .unwrap()
}

/// `compact`: no whitespace between tokens at all (llguidance's `x-guidance` option), which
/// sampled rows of a small model need less budget for.
fn person_schema(compact: bool) -> Value {
    let mut s = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 16, "pattern": "^[A-Z]"},
            "role": {"enum": ["student", "teacher", "engineer", "artist"]},
            "languages": {"type": "array", "items": {"type": "string", "maxLength": 10},
                          "minItems": 1, "maxItems": 2},
            "email": {"anyOf": [{"type": "string", "maxLength": 24, "pattern": "@"},
                                {"type": "null"}]}
        },
        "required": ["name", "age", "role", "languages"],
        "additionalProperties": false
    });
    if compact {
        s["x-guidance"] = json!({"whitespace_flexible": false});
    }
    s
}

/// The demo model's greedy output under a JSON schema (default whitespace) parses and
/// validates, and the row ends with `ConstraintEnd` (nothing may follow a complete JSON value).
#[test]
fn demo_json_schema_output_validates() {
    let Some(e) = demo() else { return };
    let schema = person_schema(false);
    let prompt = chat(&e, "Describe a fictional person as JSON.");
    let r = e
        .generate_batch(
            &prompt,
            &GenerateOptions {
                max_tokens: Some(96),
                constraint: Some(ConstraintSpec::JsonSchema(schema.clone())),
                ..GenerateOptions::default()
            },
        )
        .unwrap();
    let row = &r.rows[0];
    println!("{}", row.text);
    assert_eq!(
        row.finish_reason,
        FinishReason::ConstraintEnd,
        "{}",
        row.text
    );
    let v: Value = serde_json::from_str(&row.text).unwrap();
    validate(&v, &schema, "$").unwrap();
}

/// Sampled at temperature 1, several seeds and rows: every output parses and validates.
#[test]
fn demo_sampled_json_outputs_validate_across_seeds() {
    let Some(e) = demo() else { return };
    let schema = person_schema(true);
    let prompt = chat(&e, "Describe a fictional person as JSON.");
    let mut texts = Vec::new();
    for seed in [1, 2] {
        let r = e
            .generate_batch(
                &prompt,
                &GenerateOptions {
                    num_samples: 3,
                    constraint: Some(ConstraintSpec::JsonSchema(schema.clone())),
                    ..sampled(seed, 128)
                },
            )
            .unwrap();
        for row in &r.rows {
            println!("{}", row.text);
            assert_eq!(
                row.finish_reason,
                FinishReason::ConstraintEnd,
                "{}",
                row.text
            );
            let v: Value = serde_json::from_str(&row.text).unwrap();
            validate(&v, &schema, "$").unwrap();
            texts.push(row.text.clone());
        }
    }
    texts.dedup();
    assert!(texts.len() > 1, "sampling varies the output");
}

/// Regex and Lark constraints on the demo model: the regex output matches (checked with the
/// `regex` crate), the grammar's output is a nested list of integers (checked with serde_json).
#[test]
fn demo_regex_and_grammar_outputs_match() {
    let Some(e) = demo() else { return };
    let rx = r"(Yes|No), because [a-z]+( [a-z]+){2,6}\.";
    let r = e
        .generate_batch(
            &chat(&e, "Is the sky blue? Answer yes or no and say why."),
            &GenerateOptions {
                max_tokens: Some(40),
                constraint: Some(ConstraintSpec::Regex(rx.into())),
                ..GenerateOptions::default()
            },
        )
        .unwrap();
    let row = &r.rows[0];
    println!("{}", row.text);
    assert_eq!(
        row.finish_reason,
        FinishReason::ConstraintEnd,
        "{}",
        row.text
    );
    let full = regex::Regex::new(&format!("^(?:{rx})$")).unwrap();
    assert!(full.is_match(&row.text), "{}", row.text);

    let grammar = r#"
start: list
list: "[" value ("," " "? value)* "]"
value: INT | list
INT: /-?[0-9]{1,4}/
"#;
    let r = e
        .generate_batch(
            &chat(
                &e,
                "Write a nested list of small numbers, like [1, [2, 3]].",
            ),
            &GenerateOptions {
                max_tokens: Some(48),
                constraint: Some(ConstraintSpec::Lark(grammar.into())),
                ..GenerateOptions::default()
            },
        )
        .unwrap();
    let row = &r.rows[0];
    println!("{}", row.text);
    assert_eq!(
        row.finish_reason,
        FinishReason::ConstraintEnd,
        "{}",
        row.text
    );
    fn ints_only(v: &Value) -> bool {
        match v {
            Value::Array(a) => !a.is_empty() && a.iter().all(ints_only),
            Value::Number(n) => n.is_i64(),
            _ => false,
        }
    }
    let v: Value = serde_json::from_str(&row.text).unwrap();
    assert!(ints_only(&v), "{}", row.text);
}

/// The serving scheduler on a pool that draws tokens "on the device" (the CPU stand-in of an
/// engine emulating the decode graph, which a CUDA pool replaces with its `mask_rows` and
/// `sample_rows` kernels): constrained rows send their allowed tokens down instead of their
/// logits up. JSON-schema rows sampled at temperature 1 with three seeds, a greedy regex row and
/// a plain sampled row, all at once: each equals its request run alone on a plain engine, and
/// the JSON outputs validate.
#[test]
fn scheduler_draws_constrained_rows_where_the_logits_are() {
    let Some(plain) = demo() else { return };
    let stand_in = demo_on_a_device_stand_in();
    let schema = person_schema(true);
    let json = chat(&plain, "Describe a fictional person as JSON.");
    let mut reqs: Vec<Request> = (1..=3u64)
        .map(|seed| Request {
            prompt: json.clone(),
            options: GenerateOptions {
                constraint: Some(ConstraintSpec::JsonSchema(schema.clone())),
                ..sampled(seed, 128)
            },
            spec: None,
        })
        .collect();
    reqs.push(Request {
        prompt: chat(&plain, "Is the sky blue? Answer yes or no and say why."),
        options: GenerateOptions {
            max_tokens: Some(40),
            constraint: Some(ConstraintSpec::Regex(
                r"(Yes|No), because [a-z]+( [a-z]+){2,6}\.".into(),
            )),
            ..GenerateOptions::default()
        },
        spec: None,
    });
    reqs.push(Request {
        prompt: chat(&plain, "Name a colour."),
        options: sampled(9, 24),
        spec: None,
    });
    let handle = EngineHandle::start(Arc::clone(&stand_in), ServeOptions::default()).unwrap();
    let pending: Vec<_> = reqs
        .iter()
        .map(|r| handle.submit(r.clone()).unwrap())
        .collect();
    let got: Vec<_> = pending.into_iter().map(|p| p.wait().unwrap()).collect();
    let stats = handle.stats();
    println!("{stats:?}");
    assert!(stats.device_draw_steps > 0, "no step drew on the device");
    for (i, (req, got)) in reqs.iter().zip(&got).enumerate() {
        let alone = plain.generate_batch(&req.prompt, &req.options).unwrap();
        assert_eq!(
            got.rows[0].generated, alone.rows[0].generated,
            "request {i}"
        );
        assert_eq!(
            got.rows[0].finish_reason, alone.rows[0].finish_reason,
            "request {i}"
        );
        if i < 3 {
            let v: Value = serde_json::from_str(&got.rows[0].text).unwrap();
            validate(&v, &schema, "$").unwrap();
        }
    }
}

/// Thirty JSON schemas (`tests/fixtures/constraints/schemas.json`: nested objects, arrays with
/// bounds, enums, integers and numbers with ranges, required and optional fields, string
/// patterns, `anyOf`, top-level strings and arrays), each sampled at temperature 1 on the demo
/// model (compact JSON, all thirty at once through the serving scheduler): every output ends
/// with `constraint_end`, parses, and is valid under its schema as the `jsonschema` crate (an
/// independent validator) checks it. Then the grammar's cost: every output replayed token by
/// token through a fresh constraint, timing the mask before each token and the commit of it
/// (printed; run with `--nocapture` to see it).
#[test]
fn demo_outputs_validate_under_thirty_schemas_and_the_mask_cost_is_measured() {
    let Some(e) = demo() else { return };
    let cases: Value = serde_json::from_str(include_str!("fixtures/constraints/schemas.json"))
        .expect("schemas.json parses");
    let cases = cases.as_array().expect("an array of cases");
    assert_eq!(cases.len(), 30);
    let handle = EngineHandle::start(Arc::clone(&e), ServeOptions::default()).unwrap();
    let pending: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut schema = c["schema"].clone();
            schema["x-guidance"] = json!({"whitespace_flexible": false});
            let ask = c["ask"].as_str().unwrap();
            let prompt = chat(&e, &format!("Write {ask} as JSON."));
            let options = GenerateOptions {
                constraint: Some(ConstraintSpec::JsonSchema(schema)),
                ..sampled(1000 + i as u64, 256)
            };
            let spec = ConstraintSpec::JsonSchema(c["schema"].clone());
            let req = Request {
                prompt,
                options,
                spec: None,
            };
            (handle.submit(req).unwrap(), spec)
        })
        .collect();
    let factory = e.constraint_factory().unwrap();
    let (mut masks, mut commits, mut tokens) = (0.0f64, 0.0f64, 0usize);
    let mut worst = (0.0f64, "");
    for ((p, _), c) in pending.into_iter().zip(cases) {
        let name = c["name"].as_str().unwrap();
        let r = p.wait().unwrap();
        let row = &r.rows[0];
        println!("{name}: {}", row.text);
        assert_eq!(
            row.finish_reason,
            FinishReason::ConstraintEnd,
            "{name}: {}",
            row.text
        );
        let v: Value = serde_json::from_str(&row.text)
            .unwrap_or_else(|err| panic!("{name}: {err}: {}", row.text));
        let validator = jsonschema::validator_for(&c["schema"]).expect("a valid schema");
        let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{name}: {} {errors:?}", row.text);
        // The mask's cost: the same tokens through a fresh constraint, as generation ran them.
        let mut schema = c["schema"].clone();
        schema["x-guidance"] = json!({"whitespace_flexible": false});
        let mut con = Constraint::new(&factory, &ConstraintSpec::JsonSchema(schema)).unwrap();
        let mut here = 0.0;
        for &t in &row.generated {
            let t0 = std::time::Instant::now();
            con.allowed().unwrap();
            let t1 = std::time::Instant::now();
            con.commit(t).unwrap();
            let (m, k) = ((t1 - t0).as_secs_f64(), t1.elapsed().as_secs_f64());
            masks += m;
            commits += k;
            here += m;
        }
        tokens += row.generated.len();
        let mean = here / row.generated.len().max(1) as f64;
        if mean > worst.0 {
            worst = (mean, name);
        }
    }
    println!(
        "mask cost over {tokens} tokens of 30 schemas (demo model's {}-token vocabulary): mask \
         {:.0} µs/token, commit {:.0} µs/token; slowest schema {} at {:.0} µs/token",
        e.config().vocab_size,
        masks / tokens as f64 * 1e6,
        commits / tokens as f64 * 1e6,
        worst.1,
        worst.0 * 1e6
    );
}

/// A session's constrained rows drawn "on the device" (an engine emulating the device, whose
/// stand-in masks and draws on the host as a CUDA engine's `mask_rows` and `sample_rows` do on
/// the GPU): three JSON-schema rows sampled at temperature 1 and a greedy regex row give the
/// tokens of a plain engine, whose rows choose from logits on the host.
#[test]
fn session_draws_constrained_rows_where_the_logits_are() {
    let Some(plain) = demo() else { return };
    let stand_in = demo_on_a_device_stand_in();
    let cases = [
        (
            chat(&plain, "Describe a fictional person as JSON."),
            GenerateOptions {
                num_samples: 3,
                constraint: Some(ConstraintSpec::JsonSchema(person_schema(true))),
                ..sampled(5, 128)
            },
        ),
        (
            chat(&plain, "Is the sky blue? Answer yes or no and say why."),
            GenerateOptions {
                max_tokens: Some(40),
                constraint: Some(ConstraintSpec::Regex(
                    r"(Yes|No), because [a-z]+( [a-z]+){2,6}\.".into(),
                )),
                ..GenerateOptions::default()
            },
        ),
    ];
    for (prompt, opts) in &cases {
        let want = plain.generate_batch(prompt, opts).unwrap();
        let got = stand_in.generate_batch(prompt, opts).unwrap();
        for (w, g) in want.rows.iter().zip(&got.rows) {
            assert_eq!(g.generated, w.generated, "{}", w.text);
            assert_eq!(g.finish_reason, w.finish_reason);
        }
    }
}
