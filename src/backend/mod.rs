//! Executors of execution plans. The CPU backend is the reference every other backend is
//! checked against; the CUDA backend (feature `cuda`, on by default) must match it.

pub mod cpu;

use std::collections::BTreeMap;

use crate::kv::KvError;
use cpu::{ExecError, TokenRow};

/// Checks one step before any backend runs it: every token id is in the vocabulary, every row's
/// slot exists, each slot's tokens continue its cache contiguously, and they fit. Returns each
/// touched slot's length after the step. `len(slot)` is the slot's current length.
pub fn check_step(
    vocab: usize,
    tokens: &[u32],
    rows: &[TokenRow],
    slots: usize,
    capacity: usize,
    len: impl Fn(usize) -> usize,
) -> Result<BTreeMap<usize, usize>, ExecError> {
    if tokens.is_empty() || tokens.len() != rows.len() {
        return Err(ExecError::BadStep {
            tokens: tokens.len(),
            rows: rows.len(),
        });
    }
    if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(ExecError::BadToken { id, vocab });
    }
    let mut next: BTreeMap<usize, usize> = BTreeMap::new();
    for r in rows {
        if r.slot >= slots {
            return Err(KvError::NoSlot {
                slot: r.slot,
                slots,
            }
            .into());
        }
        let expected = next.entry(r.slot).or_insert_with(|| len(r.slot));
        if r.pos != *expected {
            return Err(ExecError::BadPosition {
                slot: r.slot,
                expected: *expected,
                found: r.pos,
            });
        }
        *expected += 1;
    }
    for (&slot, &end) in &next {
        if end > capacity {
            let len = len(slot);
            return Err(KvError::Full {
                slot,
                len,
                capacity,
                needed: end - len,
            }
            .into());
        }
    }
    Ok(next)
}
pub mod cuda;
