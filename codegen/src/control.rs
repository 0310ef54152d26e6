//! The run-time controls of the decode megakernel and of the per-op sampler: [`MkControl`], the
//! Rust mirror of `struct MkControl` in `cuda/sample.cuh` (written by the host into device
//! memory between runs), and the shape of the ring through which the megakernel reports its
//! tokens ([`RING`]).
//!
//! The C struct pins its layout with `static_assert`s; a test here checks this mirror against
//! the same numbers, read from the header's text. The device code that reads it is UNVERIFIED on
//! a GPU (compiled with NVRTC only).

use crate::MAX_BATCH;

/// Stop token ids one [`MkControl`] holds (`MK_MAX_STOP`).
pub const MAX_STOP: usize = 16;

/// Entries of the megakernel's token ring (`MK_RING`): the epoch `e` writes entry `e % RING`,
/// so the host may have at most `RING` steps in flight.
pub const RING: usize = 64;

/// u32 words of one ring entry for a kernel of batch `batch`: a token per row, the stop
/// bitmask, then the epoch (written last, after `__threadfence_system()`).
pub fn ring_stride(batch: usize) -> usize {
    batch + 2
}

/// u32 words of the whole ring (`MK_RING * (MK_BATCH + 2)`).
pub fn ring_words(batch: usize) -> usize {
    RING * ring_stride(batch)
}

/// A value [`MkControl::new`] refuses.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ControlError {
    #[error("temperature must be a finite number ≥ 0, got {0}")]
    Temperature(f32),
    #[error("top-k must be ≥ 1, got 0 (leave it unset to disable)")]
    TopK,
    #[error("top-p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("min-p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("{0} row ids, the megakernel takes at most {MAX_BATCH} rows")]
    Rows(usize),
    #[error("{0} stop ids, the device compares at most {MAX_STOP}")]
    StopIds(usize),
    #[error("stop id {0} is not a token id the device can hold (an int)")]
    StopId(u32),
}

/// Sampling controls as the device reads them (`struct MkControl`, 128 bytes, 8-aligned).
///
/// Semantics (those of `kiln::sample::sample`): `temperature` 0 is greedy; `top_k` 0, `top_p`
/// ≥ 1 and `min_p` 0 are off. `row_ids[b]` is batch row `b`'s Philox row (a u32 stored in an
/// int, bits unchanged), `stop_ids[..n_stop]` the tokens the megakernel flags in its ring.
/// Build it with [`MkControl::new`], which validates; the device also treats a temperature
/// that is not > 0 as greedy and any out-of-range cut as off.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MkControl {
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    pub row_ids: [i32; MAX_BATCH],
    pub n_stop: i32,
    pub stop_ids: [i32; MAX_STOP],
}

impl MkControl {
    /// `size_of::<MkControl>()`, and the bytes [`MkControl::as_bytes`] gives.
    pub const SIZE: usize = std::mem::size_of::<MkControl>();

    /// Controls from the engine's sampling parameters (the ranges of
    /// `kiln::sample::SamplingParams::validate`), batch rows' Philox rows and the stop ids.
    /// `top_k` above `i32::MAX` is stored as `i32::MAX` (larger than any vocabulary: off);
    /// `top_p == Some(1.0)` is off, as `None`.
    pub fn new(
        temperature: f32,
        top_k: Option<usize>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        seed: u64,
        row_ids: &[u32],
        stop_ids: &[u32],
    ) -> Result<MkControl, ControlError> {
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(ControlError::Temperature(temperature));
        }
        if top_k == Some(0) {
            return Err(ControlError::TopK);
        }
        if let Some(p) = top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ControlError::TopP(p));
            }
        }
        if let Some(p) = min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(ControlError::MinP(p));
            }
        }
        if row_ids.len() > MAX_BATCH {
            return Err(ControlError::Rows(row_ids.len()));
        }
        if stop_ids.len() > MAX_STOP {
            return Err(ControlError::StopIds(stop_ids.len()));
        }
        let mut c = MkControl {
            temperature,
            top_k: top_k.map_or(0, |k| k.min(i32::MAX as usize) as i32),
            top_p: top_p.unwrap_or(1.0),
            min_p: min_p.unwrap_or(0.0),
            seed,
            row_ids: [0; MAX_BATCH],
            n_stop: stop_ids.len() as i32,
            stop_ids: [0; MAX_STOP],
        };
        for (d, &r) in c.row_ids.iter_mut().zip(row_ids) {
            *d = r as i32;
        }
        for (d, &t) in c.stop_ids.iter_mut().zip(stop_ids) {
            *d = i32::try_from(t).map_err(|_| ControlError::StopId(t))?;
        }
        Ok(c)
    }

    /// Batch row `b`'s Philox row.
    pub fn row(&self, b: usize) -> u32 {
        self.row_ids[b] as u32
    }

    /// The struct's bytes as the device reads them (little-endian, the C layout, zero padding):
    /// what the host copies into the device's `MkControl`.
    pub fn as_bytes(&self) -> [u8; MkControl::SIZE] {
        use std::mem::offset_of;
        let mut out = [0u8; MkControl::SIZE];
        let mut put = |at: usize, b: &[u8]| out[at..at + b.len()].copy_from_slice(b);
        put(
            offset_of!(MkControl, temperature),
            &self.temperature.to_le_bytes(),
        );
        put(offset_of!(MkControl, top_k), &self.top_k.to_le_bytes());
        put(offset_of!(MkControl, top_p), &self.top_p.to_le_bytes());
        put(offset_of!(MkControl, min_p), &self.min_p.to_le_bytes());
        put(offset_of!(MkControl, seed), &self.seed.to_le_bytes());
        for (i, r) in self.row_ids.iter().enumerate() {
            put(offset_of!(MkControl, row_ids) + 4 * i, &r.to_le_bytes());
        }
        put(offset_of!(MkControl, n_stop), &self.n_stop.to_le_bytes());
        for (i, t) in self.stop_ids.iter().enumerate() {
            put(offset_of!(MkControl, stop_ids) + 4 * i, &t.to_le_bytes());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    const HEADER: &str = include_str!("../../cuda/sample.cuh");

    /// The number in `#define NAME <n>` of the header.
    fn define(name: &str) -> usize {
        let pre = format!("#define {name} ");
        let line = HEADER
            .lines()
            .find(|l| l.starts_with(&pre))
            .unwrap_or_else(|| panic!("sample.cuh has no #define {name}"));
        line[pre.len()..].trim().parse().unwrap()
    }

    /// Every `static_assert(<lhs> == <n>, ...)` of the header, as (lhs, n).
    fn asserts() -> Vec<(String, usize)> {
        HEADER
            .lines()
            .filter_map(|l| l.trim().strip_prefix("static_assert("))
            .map(|l| {
                let (lhs, rest) = l.split_once(" == ").unwrap();
                let n = rest.split(',').next().unwrap().trim().parse().unwrap();
                (lhs.to_string(), n)
            })
            .collect()
    }

    #[test]
    fn layout_matches_the_static_asserts_of_sample_cuh() {
        assert_eq!(define("MK_MAX_BATCH"), MAX_BATCH);
        assert_eq!(define("MK_MAX_STOP"), MAX_STOP);
        assert_eq!(define("MK_RING"), RING);
        let fields = [
            ("temperature", offset_of!(MkControl, temperature)),
            ("top_k", offset_of!(MkControl, top_k)),
            ("top_p", offset_of!(MkControl, top_p)),
            ("min_p", offset_of!(MkControl, min_p)),
            ("seed", offset_of!(MkControl, seed)),
            ("row_ids", offset_of!(MkControl, row_ids)),
            ("n_stop", offset_of!(MkControl, n_stop)),
            ("stop_ids", offset_of!(MkControl, stop_ids)),
        ];
        let a = asserts();
        assert_eq!(a.len(), fields.len() + 2, "{a:?}");
        for (lhs, n) in &a {
            let rust = match lhs.as_str() {
                "sizeof(MkControl)" => size_of::<MkControl>(),
                "alignof(MkControl)" => align_of::<MkControl>(),
                _ => {
                    let f = lhs
                        .strip_prefix("__builtin_offsetof(MkControl, ")
                        .and_then(|f| f.strip_suffix(')'))
                        .unwrap_or_else(|| panic!("unexpected static_assert on {lhs}"));
                    fields.iter().find(|(name, _)| *name == f).unwrap().1
                }
            };
            assert_eq!(rust, *n, "{lhs}");
        }
        assert_eq!(MkControl::SIZE, 128);
    }

    #[test]
    fn new_maps_options_to_the_device_encoding_and_bytes_follow_the_layout() {
        let c = MkControl::new(
            0.7,
            Some(40),
            None,
            Some(0.05),
            0x0102_0304_0506_0708,
            &[3, u32::MAX],
            &[2, 7],
        )
        .unwrap();
        assert_eq!((c.top_k, c.top_p, c.min_p, c.n_stop), (40, 1.0, 0.05, 2));
        assert_eq!(c.row(1), u32::MAX);
        assert_eq!(c.row_ids[2..], [0; 6]);
        let b = c.as_bytes();
        assert_eq!(b[0..4], 0.7f32.to_le_bytes());
        assert_eq!(b[4..8], 40i32.to_le_bytes());
        assert_eq!(b[8..12], 1.0f32.to_le_bytes());
        assert_eq!(b[16..24], 0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(b[24..28], 3i32.to_le_bytes());
        assert_eq!(b[28..32], [0xff; 4]);
        assert_eq!(b[56..60], 2i32.to_le_bytes());
        assert_eq!(b[60..64], 2i32.to_le_bytes());
        assert_eq!(b[64..68], 7i32.to_le_bytes());
        assert_eq!(b[124..128], [0; 4], "tail padding");
        let greedy = MkControl::new(0.0, None, Some(1.0), None, 0, &[], &[]).unwrap();
        assert_eq!((greedy.top_k, greedy.top_p, greedy.min_p), (0, 1.0, 0.0));
        let huge = MkControl::new(1.0, Some(usize::MAX), None, None, 0, &[], &[]).unwrap();
        assert_eq!(huge.top_k, i32::MAX);
        assert_eq!(ring_words(8), 64 * 10);
    }

    #[test]
    fn bad_values_are_named() {
        let new = |t: f32, k, p, m, rows: &[u32], stops: &[u32]| {
            MkControl::new(t, k, p, m, 0, rows, stops)
        };
        assert_eq!(
            new(-1.0, None, None, None, &[], &[]),
            Err(ControlError::Temperature(-1.0))
        );
        assert!(matches!(
            new(f32::NAN, None, None, None, &[], &[]),
            Err(ControlError::Temperature(_))
        ));
        assert_eq!(
            new(1.0, Some(0), None, None, &[], &[]),
            Err(ControlError::TopK)
        );
        assert_eq!(
            new(1.0, None, Some(0.0), None, &[], &[]),
            Err(ControlError::TopP(0.0))
        );
        assert_eq!(
            new(1.0, None, Some(1.5), None, &[], &[]),
            Err(ControlError::TopP(1.5))
        );
        assert_eq!(
            new(1.0, None, None, Some(-0.1), &[], &[]),
            Err(ControlError::MinP(-0.1))
        );
        assert_eq!(
            new(1.0, None, None, None, &[0; 9], &[]),
            Err(ControlError::Rows(9))
        );
        assert_eq!(
            new(1.0, None, None, None, &[], &[1; 17]),
            Err(ControlError::StopIds(17))
        );
        assert_eq!(
            new(1.0, None, None, None, &[], &[1 << 31]),
            Err(ControlError::StopId(1 << 31))
        );
        let e = new(1.0, None, None, None, &[], &[1; 17]).unwrap_err();
        assert!(e.to_string().contains("17 stop ids"), "{e}");
    }
}
