//! The bytes each token id stands for. Grammar engines match token *bytes* against a grammar,
//! and a token's bytes are not its decoded text: a byte-level BPE token can be half of a UTF-8
//! character, which `decode` would turn into U+FFFD. So the bytes are read from the vocabulary
//! strings through the inverse of the tokenizer's own decoder (GPT-2's byte-to-character
//! table, or SentencePiece's `<0xNN>` byte tokens and `▁` spaces).

use super::{byte_to_char, Tokenizer, TokenizerError};

/// One vocabulary entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenBytes {
    /// What the token decodes to, byte for byte (an added token's content as written).
    pub bytes: Vec<u8>,
    /// A special (control) token such as `<|im_end|>`: its bytes are a name, not text the
    /// model writes, and a grammar must not match them as ordinary characters.
    pub special: bool,
}

/// How the decoder turns vocabulary strings into text.
enum Decoding {
    /// GPT-2 byte-level BPE: every character of a token string stands for one byte.
    ByteLevel,
    /// SentencePiece: `<0xNN>` tokens are single bytes (when byte fallback is on) and `space`
    /// stands for ' '.
    Pieces { byte_fallback: bool, space: char },
    /// No decoder: token strings are the text.
    Plain,
}

fn decoding(json: &[u8], source: &std::path::Path) -> Result<Decoding, TokenizerError> {
    let err = |reason: String| TokenizerError::Encode {
        source_file: source.to_path_buf(),
        reason,
    };
    let doc: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| err(format!("tokenizer JSON: {e}")))?;
    let decoder = &doc["decoder"];
    if decoder.is_null() {
        return Ok(Decoding::Plain);
    }
    let parts: Vec<&serde_json::Value> = match decoder["type"].as_str() {
        Some("Sequence") => decoder["decoders"]
            .as_array()
            .map(|d| d.iter().collect())
            .unwrap_or_default(),
        _ => vec![decoder],
    };
    let kind = |v: &serde_json::Value| v["type"].as_str().unwrap_or("").to_string();
    if parts.iter().any(|p| kind(p) == "ByteLevel") {
        return Ok(Decoding::ByteLevel);
    }
    let mut space = None;
    let mut byte_fallback = false;
    for p in &parts {
        match kind(p).as_str() {
            "ByteFallback" => byte_fallback = true,
            "Metaspace" => space = p["replacement"].as_str().and_then(|s| s.chars().next()),
            "Replace" if p["content"].as_str() == Some(" ") => {
                let from = p["pattern"]["String"].as_str().unwrap_or("");
                let mut chars = from.chars();
                if let (Some(c), None) = (chars.next(), chars.next()) {
                    space = Some(c);
                }
            }
            "Fuse" | "Strip" | "Replace" => {}
            other => {
                return Err(err(format!(
                    "decoder `{other}` is not supported for constrained decoding (token bytes \
                     are known for byte-level BPE and SentencePiece vocabularies)"
                )))
            }
        }
    }
    Ok(Decoding::Pieces {
        byte_fallback,
        space: space.unwrap_or('▁'),
    })
}

/// `<0xNN>` → NN.
fn byte_token(s: &str) -> Option<u8> {
    let hex = s.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Tokenizer {
    /// The bytes of every token id below [`Tokenizer::vocab_size`]; ids the vocabulary skips
    /// get no bytes. Fails for decoders whose token bytes are not known (WordPiece, CTC) and
    /// for a byte-level token string with a character outside GPT-2's byte table.
    pub fn token_bytes(&self) -> Result<Vec<TokenBytes>, TokenizerError> {
        let decoding = decoding(&self.json, &self.source)?;
        let mut out = vec![TokenBytes::default(); self.vocab_size];
        let mut byte_of = std::collections::HashMap::with_capacity(256);
        for b in 0..=255u8 {
            byte_of.insert(byte_to_char(b), b);
        }
        for (text, id) in self.inner.get_vocab(false) {
            let Some(slot) = out.get_mut(id as usize) else {
                continue;
            };
            slot.bytes = match &decoding {
                Decoding::ByteLevel => text
                    .chars()
                    .map(|c| byte_of.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .ok_or_else(|| TokenizerError::Encode {
                        source_file: self.source.clone(),
                        reason: format!(
                            "token {id} `{text}` has a character outside the byte-level table"
                        ),
                    })?,
                Decoding::Pieces {
                    byte_fallback,
                    space,
                } => match byte_token(&text).filter(|_| *byte_fallback) {
                    Some(b) => vec![b],
                    None => text.replace(*space, " ").into_bytes(),
                },
                Decoding::Plain => text.into_bytes(),
            };
        }
        // Added tokens are matched whole in the input, so their content is their text.
        for (id, added) in self.inner.get_added_tokens_decoder() {
            if let Some(slot) = out.get_mut(id as usize) {
                *slot = TokenBytes {
                    bytes: added.content.into_bytes(),
                    special: added.special,
                };
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn byte_level_tokens_give_their_raw_bytes() {
        let tok = Tokenizer::bytes_only(Path::new("bytes"), 256).unwrap();
        let bytes = tok.token_bytes().unwrap();
        assert_eq!(bytes.len(), 256);
        for (id, t) in bytes.iter().enumerate() {
            assert_eq!(t.bytes, vec![id as u8], "token {id}");
            assert!(!t.special);
        }
    }

    #[test]
    fn sentencepiece_pieces_map_spaces_and_byte_tokens() {
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": true, "ignore_merges": false,
                      "vocab": {"<s>": 0, "<0xE6>": 1, "▁the": 2, "ab": 3}, "merges": []}
        });
        let bytes = serde_json::to_vec(&json).unwrap();
        let tok = Tokenizer::from_json(
            &bytes,
            Path::new("sp.json"),
            super::super::SpecialTokens::default(),
        )
        .unwrap();
        let got = tok.token_bytes().unwrap();
        let plain = |b: &[u8]| TokenBytes {
            bytes: b.to_vec(),
            special: false,
        };
        assert_eq!(
            got,
            vec![
                TokenBytes {
                    bytes: b"<s>".to_vec(),
                    special: true
                },
                plain(&[0xE6]),
                plain(b" the"),
                plain(b"ab"),
            ]
        );
    }

    #[test]
    fn unknown_decoders_are_refused_by_name() {
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
            "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                      "max_input_chars_per_word": 100, "vocab": {"[UNK]": 0, "a": 1}}
        });
        let bytes = serde_json::to_vec(&json).unwrap();
        let tok = Tokenizer::from_json(
            &bytes,
            Path::new("wp.json"),
            super::super::SpecialTokens::default(),
        )
        .unwrap();
        let e = tok.token_bytes().unwrap_err().to_string();
        assert!(e.contains("WordPiece") && e.contains("wp.json"), "{e}");
    }
}
