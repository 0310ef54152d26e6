//! Constrained decoding: a row's output is held to a JSON schema, any JSON object, a regular
//! expression or a Lark grammar by masking, before each sampled token, every token that could
//! not continue a match. The grammar work is llguidance's (what llama.cpp and mistral.rs use);
//! this module feeds it kiln's vocabulary and keeps one matcher per row.
//!
//! - [`ConstraintFactory`]: the token trie (every token id's bytes, from the model's own
//!   tokenizer) and llguidance's parser factory. Built once per engine
//!   ([`crate::engine::Engine::constraint_factory`]) and shared.
//! - [`Constraint`]: one row's matcher. [`Constraint::apply`] masks the row's logits;
//!   [`Constraint::commit`] advances it past every token the row emits, sampled or forced (tool
//!   output), so the grammar always sees exactly the row's text.
//!
//! The mask for a row's next token is computed while the forward pass that produces its logits
//! runs ([`prepare_during`]): after the prefill for the first token, after each decode step's
//! feed for the rest. A row whose next token is forced (tool output) gets no mask ahead; its
//! commit computes the one it checks against.
//!
//! End of sequence: the trie's end-of-sequence ids are the engine's default stop tokens; the
//! mask admits them exactly when the output so far is a complete match. A request's own stop
//! tokens that are not among them are ordinary tokens to the grammar (and special ones are
//! never allowed). Special tokens are marked in the trie, so grammar text never matches their
//! names; a Lark grammar can name them (`<|python_start|>`).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie, INVALID_TOKEN};

use super::FinishReason;
use crate::tokenizer::{TokenBytes, Tokenizer, TokenizerError};

/// The set of token ids allowed next (a bit per vocabulary id).
pub type TokenSet = toktrie::SimpleVob;

/// The whitespace allowed between two JSON tokens unless a schema says otherwise: one space, or
/// one or two newlines and up to 20 spaces or tabs of indentation (llama.cpp's JSON grammars
/// allow the same). llguidance's own default is any run of whitespace, which a small model can
/// fill its whole budget with.
pub const JSON_WHITESPACE: &str = r"\x20|\x0A{1,2}[\x20\x09]{0,20}";

/// What a row's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstraintSpec {
    /// A JSON value valid under this JSON Schema (llguidance's supported subset: objects,
    /// arrays, enums, numbers with bounds, string patterns and lengths, `anyOf`, `$ref` within
    /// the document, ...; see its json_schema documentation). Whitespace between tokens is
    /// [`JSON_WHITESPACE`] unless the schema has llguidance's `x-guidance` options object (e.g.
    /// `{"whitespace_flexible": false}` for compact JSON).
    JsonSchema(serde_json::Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// The whole output matches this regular expression (Rust `regex` syntax).
    Regex(String),
    /// A grammar in llguidance's Lark syntax (`start: ...`).
    Lark(String),
}

impl ConstraintSpec {
    /// What the spec is, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            ConstraintSpec::JsonSchema(_) => "JSON schema",
            ConstraintSpec::JsonObject => "json_object",
            ConstraintSpec::Regex(_) => "regex",
            ConstraintSpec::Lark(_) => "Lark grammar",
        }
    }

    fn grammar(&self) -> TopLevelGrammar {
        let json = |schema: &serde_json::Value| {
            let mut schema = schema.clone();
            if let Some(obj) = schema.as_object_mut() {
                obj.entry("x-guidance")
                    .or_insert(serde_json::json!({ "whitespace_pattern": JSON_WHITESPACE }));
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        match self {
            ConstraintSpec::JsonSchema(schema) => json(schema),
            ConstraintSpec::JsonObject => json(&serde_json::json!({"type": "object"})),
            ConstraintSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            ConstraintSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConstraintError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("token trie: {0}")]
    Trie(String),
    /// The spec does not compile (a bad schema, regex or grammar).
    #[error("{kind}: {reason}")]
    Grammar { kind: &'static str, reason: String },
    /// No token continues the output: the grammar needs text no token spells, or the matcher
    /// failed (a grammar too large for its limits).
    #[error("no token can continue the constrained output: {0}")]
    NoContinuation(String),
    /// A token the constraint does not allow was committed (forced tool output, or a sampler
    /// left with nothing but masked tokens).
    #[error("token {token} does not continue the constrained output")]
    Rejected { token: u32 },
}

/// The vocabulary as llguidance sees it, shared by every constraint of one engine.
pub struct ConstraintFactory {
    parsers: ParserFactory,
    vocab_size: usize,
}

impl ConstraintFactory {
    /// A factory over `tokens` (a token's bytes per id; special tokens get llguidance's marker
    /// byte), padded with byteless ids to `vocab_size` (the logits' length) or cut to it.
    /// `eos` are the ids that end a sequence (allowed when the output is a complete match).
    pub fn new(
        tokens: &[TokenBytes],
        vocab_size: usize,
        eos: &[u32],
    ) -> Result<ConstraintFactory, ConstraintError> {
        let n = u32::try_from(vocab_size)
            .map_err(|_| ConstraintError::Trie(format!("vocabulary of {vocab_size} ids")))?;
        let mut words: Vec<Vec<u8>> = tokens
            .iter()
            .take(vocab_size)
            .map(|t| {
                if t.special && !t.bytes.is_empty() {
                    let mut w = Vec::with_capacity(t.bytes.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(&t.bytes);
                    w
                } else {
                    t.bytes.clone()
                }
            })
            .collect();
        words.resize(vocab_size, Vec::new());
        let eos: Vec<u32> = eos.iter().copied().filter(|&t| t < n).collect();
        let info = TokRxInfo::new(n, eos.first().copied().unwrap_or(INVALID_TOKEN));
        let mut trie = TokTrie::from(&info, &words);
        if !eos.is_empty() {
            trie = trie.with_eos_tokens(&eos);
        }
        // Not a canonical tokenizer: llguidance then never forces a tokenization of the text
        // the grammar fixes; the mask admits every token consistent with it and the model
        // picks.
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut parsers =
            ParserFactory::new_simple(&env).map_err(|e| ConstraintError::Trie(format!("{e:#}")))?;
        parsers.quiet();
        Ok(ConstraintFactory {
            parsers,
            vocab_size,
        })
    }

    /// A factory over `tok`'s vocabulary.
    pub fn for_tokenizer(
        tok: &Tokenizer,
        vocab_size: usize,
        eos: &[u32],
    ) -> Result<ConstraintFactory, ConstraintError> {
        ConstraintFactory::new(&tok.token_bytes()?, vocab_size, eos)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The bytes the trie holds for `token` (special tokens start with the marker byte 0xFF).
    pub fn token_bytes(&self, token: u32) -> &[u8] {
        self.parsers.tok_env().tok_trie().token(token)
    }
}

/// One row's constraint state.
pub struct Constraint {
    matcher: Matcher,
    vocab_size: usize,
    /// The mask for the next token when computed ahead (`Err`: none can be computed).
    next: Option<Result<TokenSet, String>>,
}

impl Constraint {
    /// Compiles `spec` against the factory's vocabulary.
    pub fn new(
        factory: &ConstraintFactory,
        spec: &ConstraintSpec,
    ) -> Result<Constraint, ConstraintError> {
        let parser = factory.parsers.create_parser(spec.grammar()).map_err(|e| {
            ConstraintError::Grammar {
                kind: spec.kind(),
                reason: format!("{e:#}"),
            }
        })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::Grammar {
                kind: spec.kind(),
                reason: e,
            });
        }
        Ok(Constraint {
            matcher,
            vocab_size: factory.vocab_size,
            next: None,
        })
    }

    /// An independent copy in the same state (one per sample row of a request).
    pub fn fork(&self) -> Constraint {
        Constraint {
            matcher: self.matcher.deep_clone(),
            vocab_size: self.vocab_size,
            next: self.next.clone(),
        }
    }

    /// Computes the next token's mask now, if it is not known yet.
    pub fn prepare(&mut self) {
        let _ = self.allowed();
    }

    /// The tokens allowed next.
    pub fn allowed(&mut self) -> Result<&TokenSet, ConstraintError> {
        let matcher = &mut self.matcher;
        let next = self
            .next
            .get_or_insert_with(|| matcher.compute_mask().map_err(|e| format!("{e:#}")));
        match next {
            Ok(mask) => Ok(mask),
            Err(e) => Err(ConstraintError::NoContinuation(e.clone())),
        }
    }

    /// Sets every logit the constraint does not allow to −∞ (ids past the logits' end are
    /// ignored; logits past the vocabulary are masked).
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        let mask = self.allowed()?;
        let n = mask.len();
        for (i, l) in logits.iter_mut().enumerate() {
            if i >= n || !mask.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past `token`, the row's next token whether sampled or forced. `Ok(true)` when
    /// the output is now a complete match that nothing may extend (the row is done).
    pub fn commit(&mut self, token: u32) -> Result<bool, ConstraintError> {
        if (token as usize) >= self.vocab_size || !self.allowed()?.is_allowed(token) {
            return Err(ConstraintError::Rejected { token });
        }
        self.next = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError::NoContinuation(format!("{e:#}")))?;
        Ok(self.matcher.is_stopped())
    }

    /// [`Constraint::commit`] as a row's finish reason: `ConstraintEnd` when the output is
    /// complete, `ConstraintBroken` when the token does not continue it, `None` to go on.
    pub fn commit_row(&mut self, token: u32) -> Option<FinishReason> {
        match self.commit(token) {
            Ok(true) => Some(FinishReason::ConstraintEnd),
            Ok(false) => None,
            Err(_) => Some(FinishReason::ConstraintBroken),
        }
    }

    /// Whether the output is complete and nothing may extend it.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Whether the output so far is a complete match (end of sequence is allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

/// Runs `forward` on this thread while another computes each constraint's next mask, so the
/// mask costs no time the forward pass does not already take. Without constraints it just runs
/// `forward`.
pub fn prepare_during<R>(constraints: Vec<&mut Constraint>, forward: impl FnOnce() -> R) -> R {
    if constraints.is_empty() {
        return forward();
    }
    std::thread::scope(|s| {
        s.spawn(move || constraints.into_iter().for_each(Constraint::prepare));
        forward()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tokens: 0 "a", 1 "b", 2 "ab", 3 "!", 4 "é" split in two bytes (4 = 0xC3, 5 = 0xA9),
    /// 6 the special `<|end|>` (end of sequence), 7 `<|tool|>` (special).
    fn factory() -> ConstraintFactory {
        let t = |b: &[u8], special: bool| TokenBytes {
            bytes: b.to_vec(),
            special,
        };
        let tokens = [
            t(b"a", false),
            t(b"b", false),
            t(b"ab", false),
            t(b"!", false),
            t(&[0xC3], false),
            t(&[0xA9], false),
            t(b"<|end|>", true),
            t(b"<|tool|>", true),
        ];
        // Two padding ids past the vocabulary, as a model with a padded embedding has.
        ConstraintFactory::new(&tokens, 10, &[6]).unwrap()
    }

    fn allowed(c: &mut Constraint) -> Vec<u32> {
        let mask = c.allowed().unwrap();
        (0..10).filter(|&t| mask.is_allowed(t)).collect()
    }

    #[test]
    fn special_tokens_carry_the_marker_and_padding_has_no_bytes() {
        let f = factory();
        assert_eq!(f.vocab_size(), 10);
        assert_eq!(f.token_bytes(2), b"ab");
        assert_eq!(f.token_bytes(6), b"\xff<|end|>");
        assert_eq!(f.token_bytes(9), b"");
    }

    #[test]
    fn commit_advances_through_forced_tokens_and_refuses_others() {
        let f = factory();
        let spec = ConstraintSpec::Lark("start: \"a\" <|tool|> \"b\"+ \"!\"".into());
        let mut c = Constraint::new(&f, &spec).unwrap();
        // "ab" would skip the tool token.
        assert_eq!(allowed(&mut c), [0]);
        assert!(!c.commit(0).unwrap());
        assert_eq!(allowed(&mut c), [7]);
        // The tool token, as a forced token would be: committed without sampling.
        assert!(!c.commit(7).unwrap());
        assert!(matches!(
            c.commit(0),
            Err(ConstraintError::Rejected { token: 0 })
        ));
        // A refused token leaves the state as it was.
        assert_eq!(allowed(&mut c), [1]);
        assert!(!c.commit(1).unwrap());
        assert_eq!(allowed(&mut c), [1, 3]);
        assert!(!c.is_accepting());
        assert_eq!(c.commit_row(3), Some(FinishReason::ConstraintEnd));
        assert!(c.is_finished());
    }

    #[test]
    fn apply_masks_logits_and_allows_the_end_only_on_a_match() {
        let f = factory();
        let mut c = Constraint::new(&f, &ConstraintSpec::Regex("(ab)+(é)?".into())).unwrap();
        let mut logits = vec![1.0f32; 12];
        c.apply(&mut logits).unwrap();
        let kept: Vec<usize> = (0..12).filter(|&i| logits[i].is_finite()).collect();
        assert_eq!(kept, [0, 2]);
        c.commit(2).unwrap();
        // A match: the end is allowed, and so are "a", "ab" and the first byte of "é".
        assert_eq!(allowed(&mut c), [0, 2, 4, 6]);
        assert!(c.is_accepting());
        assert!(!c.commit(4).unwrap());
        // Half a character: only its second byte.
        assert_eq!(allowed(&mut c), [5]);
        assert_eq!(c.commit_row(5), Some(FinishReason::ConstraintEnd));
    }

    #[test]
    fn a_fork_is_independent() {
        let f = factory();
        let mut c = Constraint::new(&f, &ConstraintSpec::Regex("a(b|!)".into())).unwrap();
        c.commit(0).unwrap();
        let mut d = c.fork();
        assert_eq!(c.commit_row(1), Some(FinishReason::ConstraintEnd));
        assert_eq!(allowed(&mut d), [1, 3]);
        assert_eq!(d.commit_row(3), Some(FinishReason::ConstraintEnd));
    }

    #[test]
    fn no_continuation_is_reported() {
        let f = factory();
        // No token spells "c".
        let mut c = Constraint::new(&f, &ConstraintSpec::Regex("abc".into())).unwrap();
        c.commit(2).unwrap();
        let mut logits = vec![0.0f32; 10];
        assert!(matches!(
            c.apply(&mut logits),
            Err(ConstraintError::NoContinuation(_))
        ));
        assert_eq!(c.commit_row(3), Some(FinishReason::ConstraintBroken));
    }

    #[test]
    fn bad_specs_are_refused_with_their_kind() {
        let f = factory();
        let bad = [
            ConstraintSpec::Regex("a(".into()),
            ConstraintSpec::Lark("start: undefined_rule".into()),
            ConstraintSpec::JsonSchema(serde_json::json!({"type": "no-such-type"})),
        ];
        for spec in bad {
            match Constraint::new(&f, &spec) {
                Err(e @ ConstraintError::Grammar { .. }) => {
                    assert!(e.to_string().starts_with(spec.kind()), "{e}")
                }
                Err(e) => panic!("{spec:?}: {e}"),
                Ok(_) => panic!("{spec:?} compiled"),
            }
        }
        // Any JSON object compiles.
        Constraint::new(&f, &ConstraintSpec::JsonObject).unwrap();
    }
}
