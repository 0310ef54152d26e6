//! nanochat's chat format (spec §7): conversations become special-token-delimited ids with a
//! training mask — no role names or separators, the system message folded into the first user
//! turn, tool calls and their outputs as `<|python_start|>…<|python_end|>` and
//! `<|output_start|>…<|output_end|>`.

use serde::{Deserialize, Serialize};

use super::{Tokenizer, TokenizerError};

/// The nine special tokens, looked up by text (their ids depend on the vocabulary size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NanochatTokens {
    pub bos: u32,
    pub user_start: u32,
    pub user_end: u32,
    pub assistant_start: u32,
    pub assistant_end: u32,
    pub python_start: u32,
    pub python_end: u32,
    pub output_start: u32,
    pub output_end: u32,
}

impl NanochatTokens {
    /// The ids, or an error naming the first special token the vocabulary lacks.
    pub fn of(tok: &Tokenizer) -> Result<NanochatTokens, TokenizerError> {
        let id = |t: &str| {
            tok.token_to_id(t).ok_or_else(|| {
                TokenizerError::Template(format!(
                    "the vocabulary has no {t} token; not a nanochat tokenizer"
                ))
            })
        };
        Ok(NanochatTokens {
            bos: id("<|bos|>")?,
            user_start: id("<|user_start|>")?,
            user_end: id("<|user_end|>")?,
            assistant_start: id("<|assistant_start|>")?,
            assistant_end: id("<|assistant_end|>")?,
            python_start: id("<|python_start|>")?,
            python_end: id("<|python_end|>")?,
            output_start: id("<|output_start|>")?,
            output_end: id("<|output_end|>")?,
        })
    }
}

/// One piece of an assistant message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", content = "text", rename_all = "snake_case")]
pub enum Part {
    Text(String),
    /// A tool call (trained on: mask 1).
    Python(String),
    /// The tool's result (forced at inference: mask 0).
    PythonOutput(String),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Content,
}

impl Message {
    pub fn text(role: &str, text: &str) -> Message {
        Message {
            role: role.into(),
            content: Content::Text(text.into()),
        }
    }
}

/// `render_conversation`: ids and mask (1 where the assistant's own tokens are trained on),
/// truncated to `max_tokens`.
pub fn render_conversation(
    tok: &Tokenizer,
    messages: &[Message],
    max_tokens: usize,
) -> Result<(Vec<u32>, Vec<u8>), TokenizerError> {
    let s = NanochatTokens::of(tok)?;
    let mut messages = messages.to_vec();
    if messages.first().is_some_and(|m| m.role == "system") {
        let system = messages.remove(0);
        let Content::Text(sys) = system.content else {
            return Err(TokenizerError::Template(
                "a system message must be plain text".into(),
            ));
        };
        match messages.first_mut() {
            Some(Message {
                role,
                content: Content::Text(first),
            }) if role == "user" => *first = format!("{sys}\n\n{first}"),
            _ => {
                return Err(TokenizerError::Template(
                    "a system message must be followed by a user message".into(),
                ))
            }
        }
    }
    if messages.is_empty() {
        return Err(TokenizerError::Template(
            "the conversation has no messages".into(),
        ));
    }
    let mut ids = vec![s.bos];
    let mut mask = vec![0u8];
    let add = |ids_: &[u32], m: u8, ids: &mut Vec<u32>, mask: &mut Vec<u8>| {
        ids.extend_from_slice(ids_);
        mask.extend(std::iter::repeat_n(m, ids_.len()));
    };
    for (i, msg) in messages.iter().enumerate() {
        let expected = if i % 2 == 0 { "user" } else { "assistant" };
        if msg.role != expected {
            return Err(TokenizerError::Template(format!(
                "message {i} is from {:?} but roles must alternate user, assistant, ... (expected {expected:?})",
                msg.role
            )));
        }
        match (&msg.content, expected) {
            (Content::Text(t), "user") => {
                add(&[s.user_start], 0, &mut ids, &mut mask);
                add(&tok.encode_ordinary(t)?, 0, &mut ids, &mut mask);
                add(&[s.user_end], 0, &mut ids, &mut mask);
            }
            (Content::Parts(_), "user") => {
                return Err(TokenizerError::Template(format!(
                    "user message {i} must be plain text"
                )));
            }
            (content, _) => {
                add(&[s.assistant_start], 0, &mut ids, &mut mask);
                match content {
                    Content::Text(t) => add(&tok.encode_ordinary(t)?, 1, &mut ids, &mut mask),
                    Content::Parts(parts) => {
                        for p in parts {
                            match p {
                                Part::Text(t) => {
                                    add(&tok.encode_ordinary(t)?, 1, &mut ids, &mut mask)
                                }
                                Part::Python(t) => {
                                    add(&[s.python_start], 1, &mut ids, &mut mask);
                                    add(&tok.encode_ordinary(t)?, 1, &mut ids, &mut mask);
                                    add(&[s.python_end], 1, &mut ids, &mut mask);
                                }
                                Part::PythonOutput(t) => {
                                    add(&[s.output_start], 0, &mut ids, &mut mask);
                                    add(&tok.encode_ordinary(t)?, 0, &mut ids, &mut mask);
                                    add(&[s.output_end], 0, &mut ids, &mut mask);
                                }
                            }
                        }
                    }
                }
                add(&[s.assistant_end], 1, &mut ids, &mut mask);
            }
        }
    }
    ids.truncate(max_tokens);
    mask.truncate(max_tokens);
    Ok((ids, mask))
}

/// `render_for_completion`: the conversation without its final (assistant) message, primed
/// with `<|assistant_start|>` for the model to answer.
pub fn render_for_completion(
    tok: &Tokenizer,
    messages: &[Message],
) -> Result<Vec<u32>, TokenizerError> {
    let mut messages = messages.to_vec();
    if messages.last().is_some_and(|m| m.role == "assistant") {
        messages.pop();
    }
    let (mut ids, _) = render_conversation(tok, &messages, usize::MAX)?;
    ids.push(NanochatTokens::of(tok)?.assistant_start);
    Ok(ids)
}
