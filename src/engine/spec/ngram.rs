//! Prompt lookup: proposals without a second model. The sequence's last few tokens are looked
//! up earlier in its own tokens (prompt included); what followed the most recent match is
//! proposed as the continuation. Strong wherever the output copies its input: code edits,
//! summaries that quote, answers over retrieved text.

/// Longest suffix looked up.
const MAX_NGRAM: usize = 4;
/// Shortest suffix looked up: a single token matches too often to predict much.
const MIN_NGRAM: usize = 2;

/// Up to `k` tokens continuing `tokens`: what followed the most recent earlier occurrence of
/// the longest suffix (of `MAX_NGRAM` down to `MIN_NGRAM` tokens) that occurs earlier. Empty
/// when no suffix does.
pub(crate) fn propose(tokens: &[u32], k: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 {
        return Vec::new();
    }
    for n in (MIN_NGRAM..=MAX_NGRAM.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Most recent first; the match must leave at least one token after it.
        let found = (0..len - n).rev().find(|&at| &tokens[at..at + n] == suffix);
        if let Some(at) = found {
            let from = at + n;
            let to = (from + k).min(len);
            return tokens[from..to].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::propose;

    #[test]
    fn proposes_what_followed_the_longest_most_recent_match() {
        // "a b c d" occurs before; the suffix "b c" was last followed by "x y".
        let t = [1, 2, 3, 4, 9, 2, 3, 7, 8, 5, 2, 3];
        assert_eq!(propose(&t, 2), vec![7, 8]);
        // A longer suffix "9 2 3" wins over the more recent "2 3".
        let t = [9, 2, 3, 4, 5, 6, 2, 3, 7, 9, 2, 3];
        assert_eq!(propose(&t, 3), vec![4, 5, 6]);
        // The continuation may run into the suffix itself (a repeating pattern).
        let t = [1, 2, 1, 2, 1, 2];
        assert_eq!(propose(&t, 4), vec![1, 2]);
        assert!(propose(&[1, 2, 3, 4], 4).is_empty());
        assert!(
            propose(&[5, 5], 3).is_empty(),
            "one-token suffixes are not looked up"
        );
        assert!(propose(&[1, 2, 1, 2], 0).is_empty());
        assert!(propose(&[], 2).is_empty());
    }
}
