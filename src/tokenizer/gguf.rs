//! Tokenizers rebuilt from GGUF metadata.
//!
//! GGUF stores the vocabulary as flat lists (`tokenizer.ggml.*`) plus a pre-tokenizer *name*; the
//! splitting rules themselves live in llama.cpp's source. We rebuild the Hugging Face
//! `tokenizer.json` those lists came from and hand it to the `tokenizers` crate, so GGUF and HF
//! models share one tokenizer implementation. The pre-tokenizer names are mapped to the rules
//! llama.cpp applies for them; an unknown name is an error, because guessing a split would give
//! silently different token ids.

use serde_json::{json, Map, Value};

use super::{SpecialTokens, Tokenizer};
use crate::files::gguf::GgufFile;
use crate::files::LoadError;

/// Most tokens a vocabulary may have: sixteen times the largest real ones. The rebuilt
/// tokenizer costs a few hundred bytes per token, more than the file spends on each, so the
/// count is bounded by this rather than only by the file's size.
const MAX_VOCAB: usize = 1 << 22;

/// llama.cpp's token types (`llama_token_type`).
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's split regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`, HF `tokenizer.json`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's: Llama 3's with single digits.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_bytes(regex: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        byte_level(false),
    ]})
}

/// The pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre`.
fn pre_tokenizer(file: &GgufFile, pre: Option<&str>) -> Result<Value, LoadError> {
    Ok(match pre {
        None | Some("gpt2") | Some("default") => byte_level(true),
        Some("smollm") => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(true),
        ]}),
        Some("llama-bpe") => split_then_bytes(LLAMA3_SPLIT),
        Some("qwen2") => split_then_bytes(QWEN2_SPLIT),
        Some(other) => {
            return Err(LoadError::Tokenizer {
                path: file.path.clone(),
                reason: format!(
                    "pre-tokenizer `{other}` (tokenizer.ggml.pre) is not supported \
                     (kiln supports: gpt2, default, smollm, llama-bpe, qwen2)"
                ),
            })
        }
    })
}

/// A token id from metadata, checked against the vocabulary.
fn token_id(file: &GgufFile, key: &str, vocab: usize) -> Result<Option<u32>, LoadError> {
    match file.opt_u32(key)? {
        Some(id) if id as usize >= vocab => Err(LoadError::config(
            &file.path,
            key,
            format!("token id {id} is outside the vocabulary of {vocab} tokens"),
        )),
        other => Ok(other),
    }
}

/// Builds the tokenizer described by `tokenizer.ggml.*` (byte-level BPE, `gpt2`, only).
pub fn tokenizer_from_gguf(file: &GgufFile) -> Result<Tokenizer, LoadError> {
    let path = &file.path;
    let model = file.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(LoadError::Tokenizer {
            path: path.clone(),
            reason: format!(
                "tokenizer model `{model}` (tokenizer.ggml.model) is not supported; kiln reads \
                 byte-level BPE (`gpt2`) vocabularies, not sentencepiece (`llama`) ones yet"
            ),
        });
    }
    let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
    if tokens.len() > MAX_VOCAB {
        return Err(LoadError::config(
            path,
            "tokenizer.ggml.tokens",
            format!(
                "{} tokens; kiln accepts at most {MAX_VOCAB} (the largest real vocabularies \
                 have about 260,000)",
                tokens.len()
            ),
        ));
    }
    let types = match file.get("tokenizer.ggml.token_type") {
        Some(_) => file.get_int_array("tokenizer.ggml.token_type")?,
        None => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() || u32::try_from(tokens.len()).is_err() {
        return Err(LoadError::config(
            path,
            "tokenizer.ggml.token_type",
            format!("has {} entries for {} tokens", types.len(), tokens.len()),
        ));
    }
    let pre = pre_tokenizer(file, file.opt_str("tokenizer.ggml.pre")?)?;

    let mut vocab = Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    let mut unk = Value::Null;
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        // A duplicated string keeps its first id, as a JSON vocabulary would.
        vocab.entry(tok).or_insert(json!(id));
        if matches!(ty, TYPE_UNKNOWN | TYPE_CONTROL | TYPE_USER_DEFINED) {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty != TYPE_USER_DEFINED,
            }));
        }
        if ty == TYPE_UNKNOWN && unk.is_null() {
            unk = json!(tok);
        }
    }

    let merges = file
        .get_str_array("tokenizer.ggml.merges")?
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            // Like llama.cpp, split at the first space after the first character, so a merge
            // whose left side is itself a space-like token still parses.
            let at = m
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(i, _)| i);
            match at {
                Some(at) => Ok(json!([&m[..at], &m[at + 1..]])),
                None => Err(LoadError::config(
                    path,
                    "tokenizer.ggml.merges",
                    format!("merge #{i} `{m}` is not two tokens separated by a space"),
                )),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;

    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });

    let n = tokens.len();
    let bos_token_id = token_id(file, "tokenizer.ggml.bos_token_id", n)?;
    let mut eos_token_ids: Vec<u32> = token_id(file, "tokenizer.ggml.eos_token_id", n)?
        .into_iter()
        .collect();
    if let Some(eot) = token_id(file, "tokenizer.ggml.eot_token_id", n)? {
        if !eos_token_ids.contains(&eot) {
            eos_token_ids.push(eot);
        }
    }
    let specials = SpecialTokens {
        bos_token_id,
        eos_token_ids,
        add_bos_token: file
            .opt_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(false),
        chat_template: file.opt_str("tokenizer.chat_template")?.map(str::to_string),
        ordinary_text: false,
    };
    let bytes = serde_json::to_vec(&doc).map_err(|e| LoadError::json(path, e))?;
    Tokenizer::from_json(&bytes, path, specials)
}

#[cfg(test)]
mod tests {
    use super::fixture::{
        add_test_tokenizer, TOK_42, TOK_HELL, TOK_IM_END, TOK_IM_START, TOK_USER,
    };
    use super::*;
    use crate::files::gguf::writer::GgufWriter;
    use crate::files::gguf::GgufValue;
    use crate::tokenizer::byte_to_char;

    fn tokenizer(
        pre: Option<&str>,
        edit: impl FnOnce(&mut GgufWriter),
    ) -> Result<Tokenizer, LoadError> {
        let mut w = GgufWriter::new();
        add_test_tokenizer(&mut w, pre);
        edit(&mut w);
        let tmp = w.write_temp("tok");
        tokenizer_from_gguf(&GgufFile::open(tmp.path())?)
    }

    fn byte_id(c: char) -> u32 {
        (0..=255u8).find(|&b| byte_to_char(b) == c).unwrap() as u32
    }

    #[test]
    fn bpe_merges_and_round_trip() {
        let t = tokenizer(Some("smollm"), |_| {}).unwrap();
        assert_eq!(t.vocab_size(), 263);
        assert_eq!(t.encode("hello").unwrap(), vec![TOK_HELL, byte_id('o')]);
        // A leading space is the byte-level `Ġ`, and no prefix space is added.
        assert_eq!(t.encode(" o").unwrap(), vec![byte_id('Ġ'), byte_id('o')]);
        for text in [
            "hello world 42!",
            "héllo\n\n  tab\t✓ 日本 🎉",
            "<|im_start|>user\nhi<|im_end|>\n",
        ] {
            let ids = t.encode(text).unwrap();
            assert_eq!(t.decode(&ids).unwrap(), text);
        }
    }

    #[test]
    fn control_and_user_tokens_are_recognized() {
        let t = tokenizer(Some("smollm"), |_| {}).unwrap();
        let ids = t.encode("<|im_start|>hello<|im_end|><tool>").unwrap();
        assert_eq!(
            ids,
            vec![TOK_IM_START, TOK_HELL, byte_id('o'), TOK_IM_END, TOK_USER]
        );
        assert_eq!(t.specials.bos_token_id, Some(TOK_IM_START));
        assert_eq!(t.specials.eos_token_ids, vec![TOK_IM_END]);
        assert!(!t.specials.add_bos_token);
        assert!(t.specials.chat_template.is_some());
    }

    #[test]
    fn eot_joins_eos_and_add_bos_is_read() {
        let t = tokenizer(Some("gpt2"), |w| {
            w.kv("tokenizer.ggml.eot_token_id", GgufValue::U32(TOK_USER))
                .kv("tokenizer.ggml.add_bos_token", GgufValue::Bool(true));
        })
        .unwrap();
        assert_eq!(t.specials.eos_token_ids, vec![TOK_IM_END, TOK_USER]);
        assert_eq!(
            t.encode("hello").unwrap(),
            vec![TOK_IM_START, TOK_HELL, byte_id('o')]
        );
    }

    #[test]
    fn pre_tokenizers_split_digits_as_named() {
        let digits = |pre: Option<&str>| tokenizer(pre, |_| {}).unwrap().encode("42").unwrap();
        let split = vec![byte_id('4'), byte_id('2')];
        assert_eq!(digits(Some("smollm")), split);
        assert_eq!(digits(Some("qwen2")), split);
        assert_eq!(digits(Some("llama-bpe")), vec![TOK_42]);
        assert_eq!(digits(Some("gpt2")), vec![TOK_42]);
        assert_eq!(digits(Some("default")), vec![TOK_42]);
        assert_eq!(digits(None), vec![TOK_42]);
        // Llama 3's split keeps digits in runs of at most three.
        let t = tokenizer(Some("llama-bpe"), |_| {}).unwrap();
        assert_eq!(t.encode("4242").unwrap().len(), 3);
        let ids = t.encode("hello  world's\n\n x").unwrap();
        assert_eq!(t.decode(&ids).unwrap(), "hello  world's\n\n x");
    }

    #[test]
    fn unsupported_tokenizers_are_named() {
        let e = tokenizer(Some("deepseek-coder"), |_| {})
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("deepseek-coder") && e.contains("pre-tokenizer"),
            "{e}"
        );

        let e = tokenizer(None, |w| {
            w.kv("tokenizer.ggml.model", GgufValue::String("llama".into()));
        })
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("`llama`") && e.contains("sentencepiece"), "{e}");

        let e = tokenizer(None, |w| {
            w.kv("tokenizer.ggml.bos_token_id", GgufValue::U32(9999));
        })
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("tokenizer.ggml.bos_token_id") && e.contains("9999"),
            "{e}"
        );

        let e = tokenizer(None, |w| {
            w.kv(
                "tokenizer.ggml.merges",
                GgufValue::Array(vec![GgufValue::String("nospace".into())]),
            );
        })
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("tokenizer.ggml.merges") && e.contains("nospace"),
            "{e}"
        );
    }
}

/// A test tokenizer written into GGUF metadata, for the tests of both the tokenizer and the model
/// loader.
#[cfg(test)]
pub(crate) mod fixture {
    use crate::files::gguf::writer::GgufWriter;
    use crate::files::gguf::GgufValue;
    use crate::tokenizer::byte_to_char;

    /// Ids of the test tokenizer's extra tokens; they follow the 256 byte tokens, `he` (256) and `ll` (257).
    pub(crate) const TOK_HELL: u32 = 258;
    pub(crate) const TOK_42: u32 = 259;
    pub(crate) const TOK_IM_START: u32 = 260;
    pub(crate) const TOK_IM_END: u32 = 261;
    pub(crate) const TOK_USER: u32 = 262;

    /// Adds a small byte-level BPE tokenizer: the 256 byte tokens (id = byte), merges building "hell"
    /// and "42", two control tokens and one user-defined token.
    pub(crate) fn add_test_tokenizer(w: &mut GgufWriter, pre: Option<&str>) {
        let s = |x: &str| GgufValue::String(x.to_string());
        let mut tokens: Vec<GgufValue> = (0..=255u8)
            .map(|b| GgufValue::String(byte_to_char(b).to_string()))
            .collect();
        let mut types = vec![GgufValue::I32(1); 256];
        for (t, ty) in [
            ("he", 1),
            ("ll", 1),
            ("hell", 1),
            ("42", 1),
            ("<|im_start|>", 3),
            ("<|im_end|>", 3),
            ("<tool>", 4),
        ] {
            tokens.push(s(t));
            types.push(GgufValue::I32(ty));
        }
        let merges = ["h e", "l l", "he ll", "4 2"].map(s).to_vec();
        w.kv("tokenizer.ggml.model", s("gpt2"))
            .kv("tokenizer.ggml.tokens", GgufValue::Array(tokens))
            .kv("tokenizer.ggml.token_type", GgufValue::Array(types))
            .kv("tokenizer.ggml.merges", GgufValue::Array(merges))
            .kv("tokenizer.ggml.bos_token_id", GgufValue::U32(TOK_IM_START))
            .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(TOK_IM_END))
            .kv("tokenizer.ggml.add_bos_token", GgufValue::Bool(false))
            .kv(
                "tokenizer.chat_template",
                s("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"),
            );
        match pre {
            Some(p) => w.kv("tokenizer.ggml.pre", s(p)),
            None => w.remove_kv("tokenizer.ggml.pre"),
        };
    }
}
