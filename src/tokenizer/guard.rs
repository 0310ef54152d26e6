//! The boundary with the `tokenizers` crate, which panics on some inputs it should refuse (a JSON
//! syntax error inside `"decoder"` hits an `.expect("Helper")`; a `Strip` decoder whose `stop`
//! reaches past a short token indexes out of bounds, upstream tokenizers PR #2151). Documents
//! are checked before they are handed over, and every call is made under [`guarded`], so that a
//! panic left in the dependency becomes an error of the file instead of a crash.

use std::panic::{catch_unwind, AssertUnwindSafe};

use serde_json::Value;

/// Runs `f`, turning a panic into an error that says what was being done.
pub(super) fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        format!("the tokenizers library failed while {what}: {msg}")
    })
}

/// Checks what `tokenizers` does not: that the document is JSON at all (its decoder section
/// panics on a syntax error), and that no decoder would panic at decode time.
pub(super) fn check_json(json: &[u8]) -> Result<(), String> {
    let doc: Value = serde_json::from_slice(json).map_err(|e| format!("invalid JSON: {e}"))?;
    if !doc.is_object() {
        return Err("expected a JSON object".into());
    }
    if let Some(decoder) = doc.get("decoder") {
        check_decoder(decoder)?;
    }
    if let Some(model) = doc.get("model") {
        check_bpe_prefix(model)?;
    }
    Ok(())
}

/// A BPE model with a `continuing_subword_prefix` slices that many bytes off the second token
/// of every merge; a token shorter than the prefix (or one the cut would split inside a
/// character) panics in tokenizers.
fn check_bpe_prefix(model: &Value) -> Result<(), String> {
    let Some(prefix) = model
        .get("continuing_subword_prefix")
        .and_then(Value::as_str)
        .filter(|p| !p.is_empty())
    else {
        return Ok(());
    };
    let merges = model.get("merges").and_then(Value::as_array);
    for (i, m) in merges.into_iter().flatten().enumerate() {
        let second = match m {
            Value::String(s) => s.split_once(' ').map(|(_, b)| b),
            Value::Array(pair) => pair.get(1).and_then(Value::as_str),
            _ => None,
        };
        if let Some(b) = second {
            if !b.is_char_boundary(prefix.len()) {
                return Err(format!(
                    "merge #{i}: `{b}` is shorter than the continuing_subword_prefix `{prefix}`"
                ));
            }
        }
    }
    Ok(())
}

/// Refuses `Strip` decoders with `stop > 0`, anywhere in a `Sequence`: tokenizers' Strip walks
/// `stop` characters back from a token's end without checking the token is that long.
fn check_decoder(d: &Value) -> Result<(), String> {
    match d.get("type").and_then(Value::as_str) {
        Some("Strip") => match d.get("stop").and_then(Value::as_u64) {
            Some(0) | None => Ok(()),
            Some(stop) => Err(format!(
                "a Strip decoder with stop = {stop} is not supported (the tokenizers library \
                 panics on tokens shorter than that); only stop = 0 is"
            )),
        },
        // A sequence may come without its `type` (tokenizers also reads the untagged form).
        _ => d
            .get("decoders")
            .and_then(Value::as_array)
            .map_or(Ok(()), |list| list.iter().try_for_each(check_decoder)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_errors() {
        let e = guarded("testing", || -> u32 { panic!("boom {}", 1) }).unwrap_err();
        assert!(e.contains("while testing") && e.contains("boom 1"), "{e}");
        assert_eq!(guarded("testing", || 7), Ok(7));
    }

    #[test]
    fn strip_with_stop_is_refused_even_nested() {
        let doc = br#"{"decoder":{"type":"Sequence","decoders":[{"type":"Strip","content":" ","start":1,"stop":1}]}}"#;
        let e = check_json(doc).unwrap_err();
        assert!(e.contains("Strip") && e.contains("stop = 1"), "{e}");
        let untagged =
            br#"{"decoder":{"decoders":[{"type":"Strip","content":" ","start":0,"stop":2}]}}"#;
        assert!(check_json(untagged).is_err());
        let ok = br#"{"decoder":{"type":"Strip","content":" ","start":1,"stop":0}}"#;
        assert_eq!(check_json(ok), Ok(()));
    }

    #[test]
    fn merges_shorter_than_the_subword_prefix_are_refused() {
        let doc = br###"{"model":{"type":"BPE","continuing_subword_prefix":"##","merges":["a ##b","a b"]}}"###;
        let e = check_json(doc).unwrap_err();
        assert!(e.contains("merge #1") && e.contains("##"), "{e}");
        let ok = br###"{"model":{"type":"BPE","continuing_subword_prefix":"##","merges":[["a","##b"]]}}"###;
        assert_eq!(check_json(ok), Ok(()));
    }

    /// What the check prevents: tokenizers slicing inside the second token of a merge.
    #[test]
    fn the_crate_panics_without_the_check() {
        let doc = r###"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
            "model":{"type":"BPE","dropout":null,"unk_token":null,
            "continuing_subword_prefix":"##","end_of_word_suffix":null,"fuse_unk":false,
            "byte_fallback":false,"ignore_merges":false,
            "vocab":{"a":0,"b":1,"ab":2},"merges":["a b"]}}"###;
        let r = guarded("parsing", || {
            tokenizers::Tokenizer::from_bytes(doc.as_bytes())
        });
        assert!(
            r.is_err(),
            "tokenizers no longer panics here; the check may be dropped"
        );
        assert!(check_json(doc.as_bytes()).is_err());
    }
}
