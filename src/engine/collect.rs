//! Gathers a request's steps into finished rows (nanochat's `generate_batch` shape): used by a
//! session's `generate` and by a served request's `wait`.

use super::{FinishReason, RowResult, Step};

pub(super) struct RowsCollector {
    generated: Vec<Vec<u32>>,
    masks: Vec<Vec<u8>>,
    texts: Vec<String>,
    reasons: Vec<Option<FinishReason>>,
}

impl RowsCollector {
    pub fn new(rows: usize) -> RowsCollector {
        RowsCollector {
            generated: vec![Vec::new(); rows],
            masks: vec![Vec::new(); rows],
            texts: vec![String::new(); rows],
            reasons: vec![None; rows],
        }
    }

    pub fn push(&mut self, step: &Step) {
        for (r, row) in step.rows.iter().enumerate() {
            if let (Some(row), Some(g)) = (row, self.generated.get_mut(r)) {
                g.push(row.token);
                self.masks[r].push(row.mask);
                self.texts[r].push_str(&row.text);
                self.reasons[r] = row.finished;
            }
        }
    }

    /// Sets a row's reason where no step carried one (cancelled rows).
    pub fn set_reason(&mut self, row: usize, reason: FinishReason) {
        if let Some(r) = self.reasons.get_mut(row) {
            *r = Some(reason);
        }
    }

    /// The rows: prompt + generated without a terminal stop token, masks aligned with them.
    pub fn finish(self, prompt: &[u32], stop: &[u32]) -> Vec<RowResult> {
        let RowsCollector {
            generated,
            masks,
            texts,
            reasons,
        } = self;
        generated
            .into_iter()
            .zip(masks)
            .zip(texts)
            .zip(reasons)
            .map(|(((generated, masks), text), reason)| {
                let finish_reason = reason.unwrap_or(FinishReason::Cancelled);
                let keep = match generated.last() {
                    Some(t) if finish_reason == FinishReason::StopToken && stop.contains(t) => {
                        generated.len() - 1
                    }
                    _ => generated.len(),
                };
                let mut tokens = prompt.to_vec();
                tokens.extend_from_slice(&generated[..keep]);
                let mut m = vec![0u8; prompt.len()];
                m.extend_from_slice(&masks[..keep]);
                RowResult {
                    tokens,
                    masks: m,
                    generated,
                    text,
                    finish_reason,
                }
            })
            .collect()
    }
}
