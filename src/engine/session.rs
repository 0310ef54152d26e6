//! A session: one KV cache (a slot per sample row), the tokens each slot holds, and the scratch
//! memory its steps reuse. Sessions are independent; many run at once over one shared engine.

use std::sync::Arc;

use super::backend::Caches;
use super::graph_run::SessionMemory;
use super::{Engine, EngineError};
use crate::backend::TokenRow;
use crate::plan::PlanKind;

pub struct Session {
    /// The cache and scratch memory on the engine's device. Declared (so dropped) before
    /// `engine`: a CUDA decode graph still in flight reads the backend's weights, and its drop
    /// waits for it; the weights must not be freed first when this holds the last `Arc<Engine>`.
    pub(super) dev: Box<dyn Caches>,
    pub(super) engine: Arc<Engine>,
    pub(super) logits: Vec<f32>,
    /// What each slot's cache holds.
    pub(super) tokens: Vec<Vec<u32>>,
}

impl Session {
    /// The session's memory as a decode graph run reads and confirms it.
    pub(super) fn memory(&mut self) -> SessionMemory<'_> {
        SessionMemory {
            dev: &mut *self.dev,
            tokens: &mut self.tokens,
        }
    }

    /// `capacity` positions per slot, capped at the model's context.
    pub fn new(engine: Arc<Engine>, capacity: usize, slots: usize) -> Session {
        let capacity = capacity.min(engine.max_context()).max(1);
        let slots = slots.max(1);
        Session {
            dev: engine.backend.new_caches(slots, capacity),
            engine,
            logits: Vec::new(),
            tokens: vec![Vec::new(); slots],
        }
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    pub fn capacity(&self) -> usize {
        self.dev.capacity()
    }

    pub fn slots(&self) -> usize {
        self.dev.slots()
    }

    /// Tokens in the first slot's cache.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens[0]
    }

    /// Logits after the last token fed to the first slot.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Forgets everything after `len` tokens in every slot.
    pub fn truncate(&mut self, len: usize) {
        for (slot, t) in self.tokens.iter_mut().enumerate() {
            self.dev.truncate(slot, len);
            t.truncate(len);
        }
    }

    /// Appends tokens to the first slot (one forward pass) and returns the logits after the last.
    pub fn feed(&mut self, ids: &[u32]) -> Result<&[f32], EngineError> {
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let start = self.dev.len(0);
        if start + ids.len() > self.dev.capacity() {
            return Err(EngineError::PromptTooLong {
                len: start + ids.len(),
                capacity: self.dev.capacity(),
            });
        }
        let rows: Vec<TokenRow> = (0..ids.len())
            .map(|i| TokenRow {
                slot: 0,
                pos: start + i,
            })
            .collect();
        let kind = if ids.len() == 1 {
            PlanKind::Decode
        } else {
            PlanKind::Prefill
        };
        self.dev.forward(kind, ids, &rows, &mut self.logits)?;
        self.tokens[0].extend_from_slice(ids);
        Ok(&self.logits)
    }

    /// Makes the first slot hold exactly `prompt`, reusing the longest prefix already cached
    /// (a multi-turn chat re-renders the whole conversation; only the new turn is computed).
    /// Returns how many tokens had to be run.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<usize, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() > self.dev.capacity() {
            return Err(EngineError::PromptTooLong {
                len: prompt.len(),
                capacity: self.dev.capacity(),
            });
        }
        let common = reusable_prefix(&self.tokens[0], prompt);
        self.dev.truncate(0, common);
        self.tokens[0].truncate(common);
        self.feed(&prompt[common..])?;
        Ok(prompt.len() - common)
    }
}

/// How much of a cache holding `cached` serves a non-empty `prompt`: their common prefix, short
/// of the prompt's last token, which must run to produce the logits that follow it.
pub(crate) fn reusable_prefix(cached: &[u32], prompt: &[u32]) -> usize {
    let common = cached
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count();
    common.min(prompt.len().saturating_sub(1))
}
