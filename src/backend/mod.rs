//! Executors of execution plans. The CPU backend is the reference every other backend is
//! checked against; the CUDA backend (feature `cuda`, on by default) must match it.

pub mod cpu;

use std::collections::BTreeMap;

use crate::kv::KvError;
use cpu::{ExecError, TokenRow};

/// Checks one step before any backend runs it: every token id is in the vocabulary, every row's
/// slot exists, each slot's tokens are consecutive rows (kernels find a sequence's last row and
/// carry state from row to row within it), continue its cache contiguously, and fit. Returns each
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
    for (i, r) in rows.iter().enumerate() {
        if i > 0 && rows[i - 1].slot != r.slot && next.contains_key(&r.slot) {
            return Err(ExecError::Interleaved { slot: r.slot });
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(v: &[(usize, usize)]) -> Vec<TokenRow> {
        v.iter()
            .map(|&(slot, pos)| TokenRow { slot, pos })
            .collect()
    }

    #[test]
    fn a_slots_rows_must_be_consecutive() {
        let check = |r: &[(usize, usize)]| {
            let r = rows(r);
            check_step(10, &vec![1; r.len()], &r, 2, 8, |_| 0)
        };
        assert!(check(&[(0, 0), (0, 1), (1, 0)]).is_ok());
        assert_eq!(
            check(&[(0, 0), (1, 0), (0, 1)]),
            Err(ExecError::Interleaved { slot: 0 })
        );
        assert_eq!(
            check(&[(0, 1)]),
            Err(ExecError::BadPosition {
                slot: 0,
                expected: 0,
                found: 1
            })
        );
    }
}
