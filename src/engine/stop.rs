//! Per-row text and stop strings. Text is released as tokens complete characters; whatever could
//! still be the start of a stop string is held back until it either completes the match (and is
//! dropped, with everything after it) or can no longer match (and is released).

use crate::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

pub(super) struct TextTracker {
    decoder: StreamDecoder,
    held: String,
    stops: Vec<String>,
}

impl TextTracker {
    pub fn new(stops: &[String]) -> TextTracker {
        TextTracker {
            decoder: StreamDecoder::new(),
            held: String::new(),
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
        }
    }

    /// Adds one token. Returns the text now safe to emit and whether a stop string matched
    /// (then the text is everything before the match).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<(String, bool), TokenizerError> {
        let piece = self.decoder.push(tok, id)?;
        self.held.push_str(&piece);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let out = self.held[..at].to_string();
            self.held.clear();
            return Ok((out, true));
        }
        // Keep the longest tail that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        Ok((out, false))
    }

    /// Releases held text at the end of generation.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        let rest = self.decoder.finish(tok)?;
        self.held.push_str(&rest);
        Ok(std::mem::take(&mut self.held))
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop` (at a char boundary).
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = text.len().min(stop.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop
                    .as_bytes()
                    .starts_with(&text.as_bytes()[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::longest_suffix_prefix;

    #[test]
    fn suffix_prefix_overlap() {
        assert_eq!(longest_suffix_prefix("hello wor", "world"), 3);
        assert_eq!(longest_suffix_prefix("hello", "world"), 0);
        assert_eq!(longest_suffix_prefix("ab", "abc"), 2);
        assert_eq!(longest_suffix_prefix("abc", "abc"), 0);
        assert_eq!(longest_suffix_prefix("x日", "日本"), "日".len());
    }
}
