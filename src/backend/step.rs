//! What every backend shares about one step: where each token row goes (and, for a graph-replayed
//! decode, which token it embeds), the errors a step can fail with, and the checks made before any
//! backend runs it.

use std::collections::BTreeMap;

use crate::kv::KvError;

/// Where one token row of the step sits: its cache slot and absolute position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenRow {
    pub slot: usize,
    pub pos: usize,
}

/// One row to decode: the token it embeds at position `pos` of cache slot `slot`, and the
/// engine row keying its Philox draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphRow {
    pub slot: usize,
    pub pos: usize,
    pub token: u32,
    pub row_id: u32,
}

/// How one row of logits is drawn where the logits are: the row's sampling parameters, the
/// row keying its Philox draw (with the position the token takes), and optionally the tokens it
/// may take (a grammar's mask: token `i` when bit `i % 32` of word `i / 32` is set; every other
/// token weighs nothing, as after `Constraint::apply` on the host).
#[derive(Clone, Copy, Debug)]
pub struct RowDraw<'a> {
    pub sampling: crate::sample::SamplingParams,
    pub row_id: u32,
    pub allowed: Option<&'a [u32]>,
}

/// The index of each sequence's last token row (rows of one sequence are consecutive): the rows
/// whose logits a one-per-sequence step returns, in order.
pub fn last_of_each_sequence(rows: &[TokenRow]) -> Vec<usize> {
    let n = rows.len();
    (0..n)
        .filter(|&t| t + 1 == n || rows[t + 1].slot != rows[t].slot)
        .collect()
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ExecError {
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("token id {id} is outside the model's vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    #[error("slot {slot}: token at position {found} but the cache expects position {expected}")]
    BadPosition {
        slot: usize,
        expected: usize,
        found: usize,
    },
    #[error(
        "a step needs at least one token and one row per token ({tokens} tokens, {rows} rows)"
    )]
    BadStep { tokens: usize, rows: usize },
    #[error(
        "slot {slot}'s tokens must be consecutive rows of a step (another slot's row came between)"
    )]
    Interleaved { slot: usize },
    #[error(
        "logit rows must be increasing row indices below the step's {tokens} tokens (row {row})"
    )]
    BadLogitRow { row: usize, tokens: usize },
}

/// Checks rows chosen for logits: at least one, increasing, each one of the step's `tokens`
/// rows.
pub fn check_logit_rows(logit_rows: &[usize], tokens: usize) -> Result<(), ExecError> {
    if logit_rows.is_empty() {
        return Err(ExecError::BadLogitRow { row: 0, tokens });
    }
    let mut next = 0;
    for &row in logit_rows {
        if row < next || row >= tokens {
            return Err(ExecError::BadLogitRow { row, tokens });
        }
        next = row + 1;
    }
    Ok(())
}

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
        assert_eq!(check_logit_rows(&[0, 2, 3], 4), Ok(()));
        assert_eq!(
            check_logit_rows(&[], 4),
            Err(ExecError::BadLogitRow { row: 0, tokens: 4 })
        );
        for bad in [&[1, 1][..], &[2, 1], &[4]] {
            assert_eq!(
                check_logit_rows(bad, 4),
                Err(ExecError::BadLogitRow {
                    row: bad[bad.len() - 1],
                    tokens: 4
                })
            );
        }
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
