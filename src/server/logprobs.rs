//! The `logprobs` objects of OpenAI's responses, built from the engine's per-token
//! [`TokenLogprobs`] (the model's raw distribution: see `crate::engine::GenerateOptions::logprobs`).
//!
//! - chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
//!   "bytes"}]}]}`, `top_logprobs` holding the request's `top_logprobs` most likely tokens;
//! - completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, each
//!   `top_logprobs` entry a map from token text to log-probability holding the request's
//!   `logprobs` most likely tokens and the token taken (as OpenAI's and vLLM's do);
//!   `text_offset` is where each token's text starts in the completion's token texts joined.
//!
//! Every generated token gets an entry but a stop token (it ends the text and is not part of
//! it). A token's text is its bytes read as UTF-8 (a piece of a multi-byte character shows as
//! U+FFFD; `bytes` has the exact bytes).

use std::sync::OnceLock;

use serde_json::{json, Map, Value};

use super::params::Endpoint;
use crate::engine::{FinishReason, RowStep, TokenLogprobs};
use crate::tokenizer::{TokenBytes, Tokenizer};

/// Every token's bytes, read from the tokenizer on first use.
#[derive(Default)]
pub struct TokenTexts {
    table: OnceLock<Option<Vec<TokenBytes>>>,
}

impl TokenTexts {
    fn bytes(&self, tok: &Tokenizer, id: u32) -> Vec<u8> {
        let table = self.table.get_or_init(|| tok.token_bytes().ok());
        match table.as_ref().and_then(|t| t.get(id as usize)) {
            Some(b) if !b.bytes.is_empty() => b.bytes.clone(),
            // A tokenizer whose token bytes are not known: the token decoded on its own.
            _ => tok.decode(&[id]).unwrap_or_default().into_bytes(),
        }
    }
}

/// One choice's log-probabilities gathered since they were last taken (a streamed chunk's, or
/// the whole completion's).
pub struct ChoiceLogprobs {
    endpoint: Endpoint,
    /// Characters of token text before the next token (completions' `text_offset`).
    offset: usize,
    entries: Vec<(String, Vec<u8>, TokenLogprobs)>,
    /// Top alternatives' texts, resolved when pushed.
    tops: Vec<Vec<(String, Vec<u8>, f32)>>,
}

impl ChoiceLogprobs {
    pub fn new(endpoint: Endpoint) -> ChoiceLogprobs {
        ChoiceLogprobs {
            endpoint,
            offset: 0,
            entries: Vec::new(),
            tops: Vec::new(),
        }
    }

    /// Takes a row's step (one token); steps without log-probabilities and stop tokens add
    /// nothing. Returns whether it added an entry.
    pub fn push(&mut self, texts: &TokenTexts, tok: &Tokenizer, step: &RowStep) -> bool {
        let Some(lp) = &step.logprobs else {
            return false;
        };
        if step.finished == Some(FinishReason::StopToken) {
            return false;
        }
        let text = |id: u32| {
            let b = texts.bytes(tok, id);
            (String::from_utf8_lossy(&b).into_owned(), b)
        };
        let (s, b) = text(step.token);
        self.tops.push(
            lp.top
                .iter()
                .map(|&(id, p)| {
                    let (s, b) = text(id);
                    (s, b, p)
                })
                .collect(),
        );
        self.entries.push((s, b, lp.clone()));
        true
    }

    /// The JSON of the entries pushed since the last call (`null` for a request that asked
    /// for none), and forgets them.
    pub fn take(&mut self, asked: bool) -> Value {
        if !asked {
            return Value::Null;
        }
        let entries = std::mem::take(&mut self.entries);
        let tops = std::mem::take(&mut self.tops);
        match self.endpoint {
            Endpoint::Chat => {
                let content: Vec<Value> = entries
                    .into_iter()
                    .zip(tops)
                    .map(|((s, b, lp), top)| {
                        let top: Vec<Value> = top
                            .into_iter()
                            .map(|(s, b, p)| json!({"token": s, "logprob": p, "bytes": b}))
                            .collect();
                        json!({"token": s, "logprob": lp.logprob, "bytes": b, "top_logprobs": top})
                    })
                    .collect();
                json!({ "content": content })
            }
            Endpoint::Completions => {
                let mut tokens = Vec::with_capacity(entries.len());
                let mut token_logprobs = Vec::with_capacity(entries.len());
                let mut top_logprobs = Vec::with_capacity(entries.len());
                let mut text_offset = Vec::with_capacity(entries.len());
                for ((s, _, lp), top) in entries.into_iter().zip(tops) {
                    let mut m = Map::new();
                    for (t, _, p) in top {
                        m.entry(t).or_insert(json!(p));
                    }
                    m.entry(s.clone()).or_insert(json!(lp.logprob));
                    text_offset.push(self.offset);
                    self.offset += s.chars().count();
                    tokens.push(Value::String(s));
                    token_logprobs.push(json!(lp.logprob));
                    top_logprobs.push(Value::Object(m));
                }
                json!({
                    "tokens": tokens,
                    "token_logprobs": token_logprobs,
                    "top_logprobs": top_logprobs,
                    "text_offset": text_offset,
                })
            }
        }
    }
}
