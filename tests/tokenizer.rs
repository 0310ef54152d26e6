//! Tokenizers against the ids Hugging Face's tokenizers produced (`tokenizer_reference.json`),
//! for tokenizer.json and for the tokenizer kiln rebuilds from GGUF metadata, plus chat
//! templates and the streaming decoder.

mod common;

use common::fixtures;
use kiln::model::Model;
use kiln::tokenizer::{ChatMessage, StreamDecoder, Tokenizer};
use serde_json::Value;

fn reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("tokenizer_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn check_encodings(tok: &Tokenizer, what: &str) {
    let r = reference();
    for case in r["encode"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text).unwrap(),
            ids(&case["ids"]),
            "{what}: encode {text:?}"
        );
        assert_eq!(
            tok.decode(&ids(&case["ids"])).unwrap(),
            case["decoded"].as_str().unwrap(),
            "{what}: decode {text:?}"
        );
    }
    assert_eq!(
        tok.encode(r["prompt_text"].as_str().unwrap()).unwrap(),
        ids(&r["prompt_ids"])
    );
}

#[test]
fn tokenizer_json_matches_hugging_face() {
    let m = Model::load(fixtures().join("llama_tied")).unwrap();
    check_encodings(&m.tokenizer, "tokenizer.json");
}

#[test]
fn tokenizer_rebuilt_from_gguf_matches_hugging_face() {
    let m = Model::load(fixtures().join("llama_tied.f32.gguf")).unwrap();
    check_encodings(&m.tokenizer, "gguf");
    assert_eq!(m.tokenizer.specials.bos_token_id, Some(1));
    assert_eq!(m.tokenizer.specials.eos_token_ids, vec![2]);
}

#[test]
fn chat_template_renders_like_transformers() {
    let r = reference();
    let chat = &r["chat"];
    let messages: Vec<ChatMessage> = chat["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect();
    for path in ["llama_tied", "llama_tied.f32.gguf"] {
        let m = Model::load(fixtures().join(path)).unwrap();
        let rendered = m.tokenizer.apply_chat_template(&messages, true).unwrap();
        assert_eq!(rendered, chat["rendered"].as_str().unwrap(), "{path}");
        assert_eq!(
            m.tokenizer.encode(&rendered).unwrap(),
            ids(&chat["ids"]),
            "{path}"
        );
    }
}

/// Multi-byte characters split across byte-level tokens come out whole, and the pieces
/// concatenate to the full decode.
#[test]
fn stream_decoder_never_splits_a_character() {
    let m = Model::load(fixtures().join("llama_tied")).unwrap();
    let tok = &m.tokenizer;
    for text in [
        "Emoji: 🦀🔥 and 👍🏽!",
        "日本語のテキスト、中文文本。",
        "plain ascii, 42",
    ] {
        let ids = tok.encode(text).unwrap();
        let mut dec = StreamDecoder::new();
        let mut out = String::new();
        for &id in &ids {
            let piece = dec.push(tok, id).unwrap();
            assert!(
                !piece.contains('\u{FFFD}'),
                "{text:?}: piece {piece:?} splits a character"
            );
            out.push_str(&piece);
        }
        out.push_str(&dec.finish(tok).unwrap());
        assert_eq!(out, text);
    }
}

#[test]
fn out_of_range_ids_are_an_error() {
    let m = Model::load(fixtures().join("llama_tied")).unwrap();
    let err = m.tokenizer.decode(&[5, 400]).unwrap_err();
    assert!(err.to_string().contains("400"), "{err}");
}
