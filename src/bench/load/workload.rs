//! The requests every server under test gets: a fixed, seeded set of prompts of mixed lengths,
//! each asking for exactly `max_tokens` greedy tokens. Request `i` of a level is the same for
//! every server and every run with the same seed.

use serde_json::json;

/// Words the prompts are made of (common English, so any BPE tokenizer gives about one or two
/// tokens a word).
const WORDS: [&str; 64] = [
    "the", "river", "stone", "quiet", "market", "morning", "bright", "garden", "window", "letter",
    "mountain", "silver", "thread", "winter", "harbor", "lamp", "paper", "forest", "yellow",
    "bridge", "engine", "castle", "ocean", "pocket", "ladder", "candle", "meadow", "whistle",
    "copper", "lantern", "orchard", "feather", "valley", "anchor", "basket", "cloud", "desert",
    "planet", "mirror", "violin", "station", "kettle", "island", "blanket", "shadow", "compass",
    "pepper", "marble", "tunnel", "saddle", "button", "canyon", "rocket", "pillow", "signal",
    "walnut", "harvest", "glacier", "puzzle", "ribbon", "falcon", "tower", "velvet", "and",
];

/// Prompt lengths in words, from short chat turns to a few hundred tokens of context.
pub const PROMPT_WORDS: [usize; 5] = [8, 24, 64, 160, 320];

/// The seeded request set.
#[derive(Clone, Debug)]
pub struct Workload {
    pub seed: u64,
    pub max_tokens: usize,
}

/// splitmix64: a well-mixed stream from any seed.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Workload {
    /// The prompt of request `i`: a length from [`PROMPT_WORDS`] and that many words, both drawn
    /// from the seed and `i`.
    pub fn prompt(&self, i: usize) -> String {
        let mut s = mix(self.seed ^ mix(i as u64));
        let words = PROMPT_WORDS[(s % PROMPT_WORDS.len() as u64) as usize];
        let mut out = String::new();
        for w in 0..words {
            s = mix(s);
            if w > 0 {
                out.push(' ');
            }
            out.push_str(WORDS[(s % WORDS.len() as u64) as usize]);
        }
        out
    }

    /// The `/v1/completions` body of request `i`: streamed, greedy, exactly `max_tokens` tokens
    /// (`ignore_eos`, which kiln serve, llama-server and vLLM accept), with the usage in the
    /// last event so token counts come from the server.
    pub fn body(&self, i: usize) -> String {
        json!({
            "prompt": self.prompt(i),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": true,
        })
        .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_seeded_and_mixed() {
        let w = Workload {
            seed: 7,
            max_tokens: 64,
        };
        assert_eq!(w.prompt(3), w.clone().prompt(3));
        assert_ne!(w.prompt(3), w.prompt(4));
        assert_ne!(
            w.prompt(3),
            Workload {
                seed: 8,
                ..w.clone()
            }
            .prompt(3)
        );
        let lengths: std::collections::BTreeSet<usize> =
            (0..64).map(|i| w.prompt(i).split(' ').count()).collect();
        assert_eq!(
            lengths.into_iter().collect::<Vec<_>>(),
            PROMPT_WORDS.to_vec()
        );
        let body: serde_json::Value = serde_json::from_str(&w.body(3)).unwrap();
        assert_eq!(body["prompt"], w.prompt(3));
        assert_eq!(body["max_tokens"], 64);
        assert_eq!(body["ignore_eos"], true);
        assert_eq!(body["stream"], true);
    }
}
