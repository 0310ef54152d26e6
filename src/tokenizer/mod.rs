//! Text in, token ids out, and back: a thin layer over the `tokenizers` crate that adds what a
//! runtime needs around it — the model's special tokens, its chat template, and a streaming
//! decoder that never splits a UTF-8 character across two printed pieces.

mod bytes;
mod chat;
mod chat_budget;
pub mod gguf;
pub mod nanochat;
mod stream;

mod guard;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub use bytes::TokenBytes;
pub use chat::ChatMessage;
pub use stream::StreamDecoder;

use crate::files::LoadError;
use guard::{check_json, guarded};

/// GPT-2's byte-to-printable-character table (`bytes_to_unicode` in its encoder.py), which
/// byte-level BPE vocabularies are written in.
pub fn byte_to_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).expect("valid char")
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(
        "tokenizer ({}): {}",
        crate::files::EscapedPath(.source_file),
        crate::files::Escaped(.reason)
    )]
    Encode {
        source_file: PathBuf,
        reason: String,
    },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    BadId { id: u32, vocab: usize },
    #[error("model has no chat template (pass a plain prompt without --chat)")]
    NoChatTemplate,
    #[error("chat template: {}", crate::files::Escaped(.0))]
    Template(String),
}

/// Special-token facts that live beside the vocabulary (tokenizer_config.json, GGUF metadata).
#[derive(Clone, Debug, Default)]
pub struct SpecialTokens {
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Prepend BOS when encoding a prompt (Llama 2 style); SmolLM2 and Llama 3 templates add it themselves.
    pub add_bos_token: bool,
    pub chat_template: Option<String>,
    /// Special-token text in input is ordinary text (tiktoken's `encode_ordinary`, nanochat's
    /// behaviour); special ids then only come from the chat format.
    pub ordinary_text: bool,
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer without its added tokens, built on first use by
    /// [`Tokenizer::encode_ordinary`]; keeps the JSON it is built from.
    ordinary: OnceLock<Result<tokenizers::Tokenizer, String>>,
    json: Vec<u8>,
    /// Cached: `tokenizers` rebuilds its whole vocabulary map to count it.
    vocab_size: usize,
    source: PathBuf,
    pub specials: SpecialTokens,
    /// The model's context in tokens, when the tokenizer belongs to a model
    /// ([`Tokenizer::limit_prompts_to`]): a rendered chat prompt longer than it can hold is
    /// refused before it is encoded.
    context_tokens: Option<usize>,
    /// Bytes of the longest vocabulary entry, computed on first use.
    longest_token: OnceLock<usize>,
}

/// Bytes a token is assumed to cover at least, whatever the vocabulary's longest entry: text a
/// normalizer shortens still fits a prompt of context × this.
const MIN_BYTES_PER_TOKEN: usize = 16;

impl Tokenizer {
    /// Parses a `tokenizer.json` document. The document is checked first (JSON syntax, decoders
    /// `tokenizers` would panic on), and a panic inside `tokenizers` is still caught and reported
    /// as an error of this file.
    pub fn from_json(
        json: &[u8],
        source: &Path,
        specials: SpecialTokens,
    ) -> Result<Tokenizer, LoadError> {
        let err = |reason: String| LoadError::Tokenizer {
            path: source.to_path_buf(),
            reason,
        };
        check_json(json).map_err(err)?;
        let inner = guarded("parsing", || tokenizers::Tokenizer::from_bytes(json))
            .map_err(err)?
            .map_err(|e| err(e.to_string()))?;
        let vocab_size =
            guarded("counting the vocabulary", || inner.get_vocab_size(true)).map_err(err)?;
        Ok(Tokenizer {
            vocab_size,
            inner,
            ordinary: OnceLock::new(),
            json: json.to_vec(),
            source: source.to_path_buf(),
            specials,
            context_tokens: None,
            longest_token: OnceLock::new(),
        })
    }

    /// A byte-level tokenizer with `vocab_size` tokens (at least 256), no merges and no special
    /// tokens: ids below 256 are the byte values, so any text encodes (one id per UTF-8 byte);
    /// every higher id decodes to `<id>`, so whatever a model of that vocabulary generates has
    /// text. For models that have no vocabulary of their own (synthetic benchmark models).
    pub fn bytes_only(source: &Path, vocab_size: usize) -> Result<Tokenizer, LoadError> {
        let bytes = (0..=255u8).map(|b| (byte_to_char(b).to_string(), serde_json::Value::from(b)));
        // Printable ASCII is its own character in the byte-level table, so `<id>` decodes as
        // written; no such string is a single byte, so none collides with the byte tokens.
        let rest = (256..vocab_size).map(|id| (format!("<{id}>"), serde_json::Value::from(id)));
        let vocab: serde_json::Map<String, serde_json::Value> = bytes.chain(rest).collect();
        let byte_level = serde_json::json!({
            "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
        });
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": byte_level,
            "post_processor": null,
            "decoder": byte_level,
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": []
            }
        });
        let bytes = serde_json::to_vec(&json).map_err(|e| LoadError::Tokenizer {
            path: source.to_path_buf(),
            reason: e.to_string(),
        })?;
        Tokenizer::from_json(&bytes, source, SpecialTokens::default())
    }

    /// Refuses rendered chat prompts that a context of `tokens` cannot hold (see
    /// [`Tokenizer::max_prompt_bytes`]). Set by `Model::load` from the model's context.
    pub fn limit_prompts_to(&mut self, tokens: usize) {
        self.context_tokens = Some(tokens);
    }

    /// The longest rendered chat prompt worth encoding: the context in tokens times the bytes
    /// one token can cover (the longest vocabulary entry's bytes, at least
    /// [`MIN_BYTES_PER_TOKEN`]). Encoding needs tens of bytes of memory per byte of text, so a
    /// template that renders megabytes is refused here instead of exhausting memory in the
    /// encoder. `None` when the tokenizer belongs to no model.
    pub fn max_prompt_bytes(&self) -> Option<usize> {
        let context = self.context_tokens?;
        let longest = *self.longest_token.get_or_init(|| {
            guarded("measuring the vocabulary", || {
                self.inner
                    .get_vocab(true)
                    .keys()
                    .map(String::len)
                    .max()
                    .unwrap_or(0)
            })
            .unwrap_or(0)
        });
        Some(context.saturating_mul(longest.max(MIN_BYTES_PER_TOKEN)))
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        guarded("looking up a token", || self.inner.token_to_id(token))
            .ok()
            .flatten()
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        guarded("looking up an id", || self.inner.id_to_token(id))
            .ok()
            .flatten()
    }

    fn encode_error(&self, reason: String) -> TokenizerError {
        TokenizerError::Encode {
            source_file: self.source.clone(),
            reason,
        }
    }

    /// Encodes text; special-token strings in it (e.g. `<|im_start|>`) become their ids, as in
    /// Hugging Face's tokenizers. BOS is prepended only when the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        if self.specials.ordinary_text {
            return self.encode_ordinary(text);
        }
        let enc = guarded("encoding", || self.inner.encode(text, false))
            .map_err(|e| self.encode_error(e))?
            .map_err(|e| self.encode_error(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.specials.add_bos_token {
            if let Some(bos) = self.specials.bos_token_id {
                if enc.get_ids().first() != Some(&bos) {
                    ids.push(bos);
                }
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Encodes text with special-token strings treated as ordinary text (tiktoken's
    /// `encode_ordinary`, what nanochat's tokenizer does): `"<|bos|>"` in user text is never BOS.
    pub fn encode_ordinary(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let err = |reason: String| TokenizerError::Encode {
            source_file: self.source.clone(),
            reason,
        };
        let plain = self
            .ordinary
            .get_or_init(|| {
                let mut v: serde_json::Value =
                    serde_json::from_slice(&self.json).map_err(|e| e.to_string())?;
                if let Some(obj) = v.as_object_mut() {
                    obj.insert("added_tokens".into(), serde_json::Value::Array(vec![]));
                }
                let bytes = serde_json::to_vec(&v).map_err(|e| e.to_string())?;
                guarded("parsing", || tokenizers::Tokenizer::from_bytes(&bytes))?
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| err(e.clone()))?;
        let enc = guarded("encoding", || plain.encode(text, false))
            .map_err(err)?
            .map_err(|e| err(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, special tokens included (as their literal text).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let vocab = self.vocab_size();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(TokenizerError::BadId { id, vocab });
        }
        guarded("decoding", || self.inner.decode(ids, false))
            .map_err(|e| self.encode_error(e))?
            .map_err(|e| self.encode_error(e.to_string()))
    }

    /// The prompt ids for a chat: the model's chat template when it has one, else nanochat's
    /// format when the vocabulary has nanochat's special tokens.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError> {
        if self.specials.chat_template.is_some() {
            let text = self.apply_chat_template(messages, true)?;
            if let Some(limit) = self.max_prompt_bytes().filter(|&l| text.len() > l) {
                return Err(TokenizerError::Template(format!(
                    "rendered a prompt of {} bytes from {} message(s), more than the model's \
                     context of {} tokens can hold (at most {limit} bytes); refusing to encode it",
                    text.len(),
                    messages.len(),
                    self.context_tokens.unwrap_or(0)
                )));
            }
            return self.encode(&text);
        }
        if nanochat::NanochatTokens::of(self).is_ok() {
            let msgs: Vec<nanochat::Message> = messages
                .iter()
                .map(|m| nanochat::Message::text(&m.role, &m.content))
                .collect();
            return nanochat::render_for_completion(self, &msgs);
        }
        Err(TokenizerError::NoChatTemplate)
    }

    /// Renders messages through the model's chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self
            .specials
            .chat_template
            .as_deref()
            .ok_or(TokenizerError::NoChatTemplate)?;
        let token_text = |id: Option<u32>| id.and_then(|i| self.id_to_token(i)).unwrap_or_default();
        chat::render(
            template,
            messages,
            add_generation_prompt,
            &token_text(self.specials.bos_token_id),
            &token_text(self.specials.eos_token_ids.first().copied()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte tokenizer (longest entry 2 bytes) for a model of 8 tokens of context: prompts up
    /// to 8 × 16 bytes encode, a longer rendered prompt is refused before encoding.
    #[test]
    fn a_rendered_prompt_longer_than_the_context_can_hold_is_refused() {
        let mut tok = Tokenizer::bytes_only(Path::new("tokenizer.json"), 256).unwrap();
        tok.specials.chat_template = Some("{{ messages[0].content }}".into());
        let fits = [ChatMessage::new("user", "a".repeat(128))];
        let too_long = [ChatMessage::new("user", "a".repeat(129))];
        assert_eq!(tok.chat_prompt(&too_long).unwrap().len(), 129);
        tok.limit_prompts_to(8);
        assert_eq!(tok.max_prompt_bytes(), Some(128));
        assert_eq!(tok.chat_prompt(&fits).unwrap().len(), 128);
        let err = tok.chat_prompt(&too_long).unwrap_err().to_string();
        assert!(
            err.starts_with("chat template: rendered a prompt of 129 bytes")
                && err.contains("context of 8 tokens"),
            "{err}"
        );
    }
}
