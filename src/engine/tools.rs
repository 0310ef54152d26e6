//! Tool use, per row (spec §6): tokens between `<|python_start|>` and `<|python_end|>` are an
//! expression; when the block closes, the calculator's result is queued as
//! `<|output_start|>` result `<|output_end|>`, which the row then emits as forced tokens (mask 0)
//! and feeds to the model like any other token.

use std::collections::VecDeque;

use super::calculator::use_calculator;
use crate::tokenizer::{Tokenizer, TokenizerError};

#[derive(Clone, Copy, Debug)]
pub(super) struct ToolTokens {
    python_start: u32,
    python_end: u32,
    output_start: u32,
    output_end: u32,
}

impl ToolTokens {
    /// The tool tokens, if the vocabulary has all four.
    pub fn of(tok: &Tokenizer) -> Option<ToolTokens> {
        Some(ToolTokens {
            python_start: tok.token_to_id("<|python_start|>")?,
            python_end: tok.token_to_id("<|python_end|>")?,
            output_start: tok.token_to_id("<|output_start|>")?,
            output_end: tok.token_to_id("<|output_end|>")?,
        })
    }
}

#[derive(Default)]
pub(super) struct ToolState {
    in_python: bool,
    expr: Vec<u32>,
    /// Tokens the row must emit next, in order.
    pub forced: VecDeque<u32>,
}

impl ToolState {
    /// Advances the state machine past `token` (sampled or forced).
    pub fn on_token(
        &mut self,
        t: &ToolTokens,
        tok: &Tokenizer,
        token: u32,
    ) -> Result<(), TokenizerError> {
        if token == t.python_start {
            self.in_python = true;
            self.expr.clear();
        } else if token == t.python_end && self.in_python {
            self.in_python = false;
            if !self.expr.is_empty() {
                let expr = tok.decode(&self.expr)?;
                if let Some(result) = use_calculator(&expr) {
                    self.forced.push_back(t.output_start);
                    self.forced.extend(tok.encode_ordinary(&result)?);
                    self.forced.push_back(t.output_end);
                }
            }
            self.expr.clear();
        } else if self.in_python {
            self.expr.push(token);
        }
        Ok(())
    }
}
