//! How many positions a session's KV cache gets: what the run needs, capped by the context
//! asked for (`-c`), the model's context and the memory available — computed with checked
//! arithmetic, so that a model claiming 2^62 positions, `-n 18446744073709551615` or
//! `--samples 1000000000` is a message, not a wrapped size, a panic or an aborted allocation.

use super::memory::Available;
use crate::graph::{human_bytes as human, KvSpec};

/// The context `kiln` uses when `-c` is not given and the model allows more: llama.cpp's
/// default, and far below the 128k of recent models, whose cache would not fit on most machines.
pub const DEFAULT_CONTEXT: usize = 4096;

/// Bytes one position of one sequence takes in the host's f32 KV cache: K and V for every
/// layer and KV head, plus the per-position state; `None` when a model's shape overflows the
/// count.
pub fn kv_bytes_per_position(spec: &KvSpec) -> Option<usize> {
    let kv = spec
        .layers
        .checked_mul(spec.kv_heads)?
        .checked_mul(spec.head_dim)?
        .checked_mul(2)?;
    kv.checked_add(spec.state_dim)?.checked_mul(4)
}

/// What a run asks of the cache.
#[derive(Clone, Copy, Debug)]
pub struct CacheRequest {
    /// `max_position_embeddings` of the model.
    pub model_context: usize,
    /// `-c N`: `None` for the default, `Some(0)` for the model's whole context.
    pub ctx_flag: Option<usize>,
    /// Positions the run can use at most (prompt + `-n`, saturated); `None` when it can use
    /// the whole context (chat).
    pub needed: Option<usize>,
    /// Cache slots (one per sample row).
    pub slots: usize,
    /// Bytes one position of one slot takes; `None` when that count overflows.
    pub bytes_per_position: Option<usize>,
    /// Bytes each slot needs besides its positions (its logits row).
    pub bytes_per_slot: usize,
    /// Memory available for the cache; `None` skips the check (not Linux, or a GPU cache).
    pub available: Option<Available>,
}

/// The cache to allocate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachePlan {
    /// Positions per slot.
    pub positions: usize,
    /// Bytes the cache and the per-slot rows take.
    pub bytes: u64,
    /// One line for stderr when the model's context was cut, saying why and how to change it.
    pub note: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CacheError {
    #[error("-c {requested} is more than the model's context of {model} positions")]
    OverModel { requested: usize, model: usize },
    #[error(
        "a KV cache of {slots} slot(s) × {positions} positions is too large to count in bytes{hint}"
    )]
    Overflow {
        slots: usize,
        positions: usize,
        hint: Hint,
    },
    #[error(
        "a KV cache of {slots} slot(s) × {positions} positions needs {need} but may take at most \
         {usable}, 3/4 of the {avail} available ({limit}){hint}",
        need = human(*need),
        usable = human(*avail - *avail / 4),
        avail = human(*avail)
    )]
    TooLarge {
        slots: usize,
        positions: usize,
        need: u64,
        avail: u64,
        limit: String,
        hint: Hint,
    },
}

/// What to change when the cache does not fit: the flags that set its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hint {
    pub samples: bool,
}

impl std::fmt::Display for Hint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.samples {
            f.write_str("; pass a smaller -c, -n or --samples")
        } else {
            f.write_str("; pass a smaller -c or -n")
        }
    }
}

/// Bytes of `slots` slots of `positions` positions, `None` on overflow.
fn cache_bytes(req: &CacheRequest, positions: usize) -> Option<u64> {
    let per_slot = positions
        .checked_mul(req.bytes_per_position?)?
        .checked_add(req.bytes_per_slot)?;
    u64::try_from(per_slot.checked_mul(req.slots)?).ok()
}

pub fn plan(req: &CacheRequest) -> Result<CachePlan, CacheError> {
    let model = req.model_context.max(1);
    let limit = match req.ctx_flag {
        Some(0) => model,
        Some(c) if c > model => {
            return Err(CacheError::OverModel {
                requested: c,
                model,
            })
        }
        Some(c) => c,
        None => model.min(DEFAULT_CONTEXT),
    };
    let wanted = req.needed.map_or(limit, |n| n.clamp(1, limit));
    let slots = req.slots.max(1);
    let hint = Hint {
        samples: req.slots > 1,
    };
    let cut = req.ctx_flag.is_none() && wanted < req.needed.unwrap_or(usize::MAX).min(model);
    let mut note = cut.then(|| {
        format!(
            "kiln: context of {wanted} positions of the model's {model} (-c N to change, -c 0 \
             for all)"
        )
    });
    let positions = match (cache_bytes(req, wanted), req.available) {
        (None, _) => {
            return Err(CacheError::Overflow {
                slots,
                positions: wanted,
                hint,
            })
        }
        (Some(bytes), Some(avail)) if bytes > avail.usable() => {
            // Without -c, the cache shrinks to what memory holds; a context that was asked
            // for is refused rather than silently cut.
            let fit = fitting_positions(req, avail.usable());
            if req.ctx_flag.is_some() || fit == 0 {
                return Err(CacheError::TooLarge {
                    slots,
                    positions: wanted,
                    need: bytes,
                    avail: avail.bytes,
                    limit: avail.limit.to_string(),
                    hint,
                });
            }
            note = Some(format!(
                "kiln: context cut to {fit} positions of the model's {model}: what {} of \
                 memory holds ({}); -c N to choose",
                human(avail.usable()),
                avail.limit
            ));
            fit
        }
        _ => wanted,
    };
    Ok(CachePlan {
        positions,
        bytes: cache_bytes(req, positions).unwrap_or(u64::MAX),
        note,
    })
}

/// The most positions per slot whose cache fits in `bytes`.
fn fitting_positions(req: &CacheRequest, bytes: u64) -> usize {
    let slots = req.slots.max(1) as u64;
    let per_position = req.bytes_per_position.unwrap_or(usize::MAX).max(1) as u64;
    let per_slot = bytes / slots;
    let room = per_slot.saturating_sub(req.bytes_per_slot as u64);
    usize::try_from(room / per_position).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::super::memory::Limit;
    use super::*;

    fn req() -> CacheRequest {
        CacheRequest {
            model_context: 8192,
            ctx_flag: None,
            needed: None,
            slots: 1,
            bytes_per_position: Some(46_080),
            bytes_per_slot: 196_608,
            available: Some(Available {
                bytes: 8 << 30,
                limit: Limit::MemAvailable,
            }),
        }
    }

    #[test]
    fn bytes_per_position_is_checked() {
        let spec = KvSpec {
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            state_dim: 0,
        };
        // SmolLM2-135M: 30 layers × 3 KV heads × 64 × (K, V) × 4 bytes.
        assert_eq!(kv_bytes_per_position(&spec), Some(46_080));
        let nanochat = KvSpec {
            state_dim: 8,
            ..spec
        };
        assert_eq!(kv_bytes_per_position(&nanochat), Some(46_080 + 32));
        let huge = KvSpec {
            head_dim: 1 << 62,
            ..spec
        };
        assert_eq!(kv_bytes_per_position(&huge), None);
    }

    #[test]
    fn chat_defaults_to_4096_and_says_so() {
        let p = plan(&req()).unwrap();
        assert_eq!(p.positions, 4096);
        assert_eq!(p.bytes, 4096 * 46_080 + 196_608);
        assert!(p
            .note
            .unwrap()
            .contains("4096 positions of the model's 8192"));
        let small = plan(&CacheRequest {
            model_context: 256,
            ..req()
        })
        .unwrap();
        assert_eq!((small.positions, small.note), (256, None));
    }

    #[test]
    fn one_shot_takes_what_it_needs_and_saturated_needs_are_capped() {
        let p = plan(&CacheRequest {
            needed: Some(300),
            ..req()
        })
        .unwrap();
        assert_eq!((p.positions, p.note), (300, None));
        let p = plan(&CacheRequest {
            needed: Some(usize::MAX),
            ..req()
        })
        .unwrap();
        assert_eq!(p.positions, 4096);
        assert!(p.note.is_some());
    }

    #[test]
    fn ctx_flag_is_bounded_by_the_model() {
        let p = plan(&CacheRequest {
            ctx_flag: Some(0),
            ..req()
        })
        .unwrap();
        assert_eq!((p.positions, p.note), (8192, None));
        assert_eq!(
            plan(&CacheRequest {
                ctx_flag: Some(9000),
                ..req()
            }),
            Err(CacheError::OverModel {
                requested: 9000,
                model: 8192
            })
        );
    }

    #[test]
    fn absurd_model_contexts_neither_wrap_nor_allocate() {
        for ctx in [
            1usize << 31,
            1 << 40,
            1 << 62,
            u32::MAX as usize,
            usize::MAX,
        ] {
            let p = plan(&CacheRequest {
                model_context: ctx,
                ..req()
            })
            .unwrap();
            assert_eq!(p.positions, 4096, "{ctx}");
            let e = plan(&CacheRequest {
                model_context: ctx,
                ctx_flag: Some(0),
                ..req()
            })
            .unwrap_err();
            assert!(
                matches!(e, CacheError::TooLarge { .. } | CacheError::Overflow { .. }),
                "{ctx}: {e:?}"
            );
        }
    }

    #[test]
    fn samples_that_cannot_fit_are_refused() {
        let e = plan(&CacheRequest {
            slots: usize::MAX,
            needed: Some(20),
            ..req()
        })
        .unwrap_err();
        assert!(matches!(e, CacheError::Overflow { .. }), "{e:?}");
        assert!(e.to_string().contains("--samples"), "{e}");
        let e = plan(&CacheRequest {
            slots: 1_000_000_000,
            needed: Some(20),
            ..req()
        })
        .unwrap_err();
        assert!(matches!(e, CacheError::TooLarge { .. }), "{e:?}");
    }

    #[test]
    fn without_ctx_flag_memory_cuts_the_context_and_with_it_refuses() {
        let tight = Some(Available {
            bytes: 100 << 20,
            limit: Limit::AddressSpace,
        });
        let p = plan(&CacheRequest {
            available: tight,
            ..req()
        })
        .unwrap();
        let usable = (100u64 << 20) - (100 << 20) / 4;
        assert_eq!(p.positions as u64, (usable - 196_608) / 46_080);
        assert!(p.bytes <= usable);
        assert!(p.note.unwrap().contains("ulimit -v"));
        let e = plan(&CacheRequest {
            available: tight,
            ctx_flag: Some(4096),
            ..req()
        })
        .unwrap_err();
        assert!(e.to_string().contains("pass a smaller -c"), "{e}");
        let none = plan(&CacheRequest {
            available: Some(Available {
                bytes: 1000,
                limit: Limit::MemAvailable,
            }),
            ..req()
        });
        assert!(matches!(none, Err(CacheError::TooLarge { .. })));
    }

    #[test]
    fn unknown_memory_skips_the_check_but_not_the_arithmetic() {
        let p = plan(&CacheRequest {
            available: None,
            ctx_flag: Some(8192),
            ..req()
        })
        .unwrap();
        assert_eq!(p.positions, 8192);
        let e = plan(&CacheRequest {
            available: None,
            bytes_per_position: None,
            ..req()
        });
        assert!(matches!(e, Err(CacheError::Overflow { .. })));
    }
}
