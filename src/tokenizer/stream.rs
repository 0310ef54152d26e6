//! Incremental detokenization. A byte-level BPE token can end in the middle of a UTF-8 character
//! (emoji, CJK), so text is only released once it decodes without a trailing replacement
//! character; the held-back bytes come out with the token that completes them.

use super::{Tokenizer, TokenizerError};

/// How many already-printed tokens are re-decoded with each new one, so that decoders which
/// depend on context (a leading space, a byte fallback) see enough of it.
const CONTEXT_TOKENS: usize = 6;

#[derive(Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the window re-decoded for context.
    prefix: usize,
    /// Tokens up to here have been printed.
    read: usize,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds one token; returns the text it completes, possibly empty.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let after = tok.decode(&self.ids[self.prefix..])?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') && after.starts_with(&before)
        {
            let text = after[before.len()..].to_string();
            self.read = self.ids.len();
            self.prefix = self.read.saturating_sub(CONTEXT_TOKENS);
            Ok(text)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever is still held back (an incomplete character at the end of generation).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let after = tok.decode(&self.ids[self.prefix..])?;
        self.read = self.ids.len();
        Ok(after.get(before.len()..).unwrap_or("").to_string())
    }
}
