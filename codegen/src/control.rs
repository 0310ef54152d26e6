//! The run-time controls of the decode megakernel and of the per-op sampler: [`MkRow`] (one batch
//! row's sampling parameters, Philox row and seed) and [`MkControl`] (a row table of
//! [`MAX_BATCH`] of them and the stop ids), the Rust mirrors of `struct MkRow` / `struct
//! MkControl` in `cuda/sample.cuh` (written by the host into device memory between runs), and the
//! shape of the ring through which the megakernel reports its tokens ([`RING`]).
//!
//! Per-row controls are what let rows with different parameters share one launch, and a row join
//! or leave a captured graph between replays: the host rewrites one row's entry (32 bytes at
//! [`MkControl::row_offset`]) and the kernel reads it at replay. Whether a row is live is the
//! kernel's position array (`pos[b] < 0`: inactive), not a field here.
//!
//! The C structs pin their layout with `static_assert`s; a test here checks these mirrors
//! against the same numbers, read from the header's text. The device code that reads them ran
//! on an H200 (kiln's docs/gpu-results.md): the per-op sampler, driven by these rows, picks the
//! host sampler's tokens, and rows joining and leaving a replayed graph pass on every fixture;
//! on the demo model (SmolLM2) the join/leave test FAILS (the row that left differs from the
//! per-op reference one step in), not yet shown to be a near tie.

use crate::MAX_BATCH;

/// Stop token ids one [`MkControl`] holds (`MK_MAX_STOP`).
pub const MAX_STOP: usize = 16;

/// Entries of the megakernel's token ring (`MK_RING`): the epoch `e` writes entry `e % RING`,
/// so the host may have at most `RING` steps in flight.
pub const RING: usize = 64;

/// The ring token of an inactive batch row (`MK_NO_TOKEN`).
pub const NO_TOKEN: u32 = u32::MAX;

/// u32 words of one ring entry for a kernel of batch `batch`: a token per row, the stop
/// bitmask, then the epoch (written last, after `__threadfence_system()`).
pub fn ring_stride(batch: usize) -> usize {
    batch + 2
}

/// u32 words of the whole ring (`MK_RING * (MK_BATCH + 2)`).
pub fn ring_words(batch: usize) -> usize {
    RING * ring_stride(batch)
}

/// A value [`MkRow::new`] or [`MkControl::new`] refuses.
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
    #[error("{0} rows, the megakernel takes at most {MAX_BATCH} rows")]
    Rows(usize),
    #[error("batch row {0}: the megakernel has rows 0..{MAX_BATCH}")]
    Row(usize),
    #[error("{0} stop ids, the device compares at most {MAX_STOP}")]
    StopIds(usize),
    #[error("stop id {0} is not a token id the device can hold (an int)")]
    StopId(u32),
}

/// One batch row's sampling controls as the device reads them (`struct MkRow`, 32 bytes,
/// 8-aligned).
///
/// Semantics (those of `kiln::sample::sample`): `temperature` 0 is greedy; `top_k` 0, `top_p`
/// ≥ 1 and `min_p` 0 are off. `row_id` is the row's Philox row (a u32 stored in an int, bits
/// unchanged), `seed` its Philox key. Build it with [`MkRow::new`], which validates; the device
/// also treats a temperature that is not > 0 as greedy and any out-of-range cut as off.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MkRow {
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    pub row_id: i32,
    /// Always 0 (the C struct's explicit tail padding).
    pub pad: i32,
}

impl MkRow {
    /// `size_of::<MkRow>()`, and the bytes [`MkRow::as_bytes`] gives.
    pub const SIZE: usize = std::mem::size_of::<MkRow>();

    /// Greedy, Philox row 0: what an unused entry of the row table holds.
    pub const GREEDY: MkRow = MkRow {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
        row_id: 0,
        pad: 0,
    };

    /// Controls from the engine's sampling parameters (the ranges of
    /// `kiln::sample::SamplingParams::validate`) and the row's Philox row. `top_k` above
    /// `i32::MAX` is stored as `i32::MAX` (larger than any vocabulary: off); `top_p ==
    /// Some(1.0)` is off, as `None`.
    pub fn new(
        temperature: f32,
        top_k: Option<usize>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        seed: u64,
        row_id: u32,
    ) -> Result<MkRow, ControlError> {
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
        Ok(MkRow {
            temperature,
            top_k: top_k.map_or(0, |k| k.min(i32::MAX as usize) as i32),
            top_p: top_p.unwrap_or(1.0),
            min_p: min_p.unwrap_or(0.0),
            seed,
            row_id: row_id as i32,
            pad: 0,
        })
    }

    /// The Philox row.
    pub fn row(&self) -> u32 {
        self.row_id as u32
    }

    /// The struct's bytes as the device reads them (little-endian, the C layout).
    pub fn as_bytes(&self) -> [u8; MkRow::SIZE] {
        use std::mem::offset_of;
        let mut out = [0u8; MkRow::SIZE];
        let mut put = |at: usize, b: &[u8]| out[at..at + b.len()].copy_from_slice(b);
        put(
            offset_of!(MkRow, temperature),
            &self.temperature.to_le_bytes(),
        );
        put(offset_of!(MkRow, top_k), &self.top_k.to_le_bytes());
        put(offset_of!(MkRow, top_p), &self.top_p.to_le_bytes());
        put(offset_of!(MkRow, min_p), &self.min_p.to_le_bytes());
        put(offset_of!(MkRow, seed), &self.seed.to_le_bytes());
        put(offset_of!(MkRow, row_id), &self.row_id.to_le_bytes());
        put(offset_of!(MkRow, pad), &self.pad.to_le_bytes());
        out
    }
}

/// The megakernel's controls as the device reads them (`struct MkControl`, 328 bytes,
/// 8-aligned): batch row `b` samples with `rows[b]`; `stop_ids[..n_stop]` are the tokens the
/// megakernel flags in its ring.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MkControl {
    pub rows: [MkRow; MAX_BATCH],
    pub n_stop: i32,
    pub stop_ids: [i32; MAX_STOP],
}

impl MkControl {
    /// `size_of::<MkControl>()`, and the bytes [`MkControl::as_bytes`] gives.
    pub const SIZE: usize = std::mem::size_of::<MkControl>();

    /// Controls for batch rows `rows` (the rest of the table is [`MkRow::GREEDY`]) and the stop
    /// ids.
    pub fn new(rows: &[MkRow], stop_ids: &[u32]) -> Result<MkControl, ControlError> {
        if rows.len() > MAX_BATCH {
            return Err(ControlError::Rows(rows.len()));
        }
        if stop_ids.len() > MAX_STOP {
            return Err(ControlError::StopIds(stop_ids.len()));
        }
        let mut c = MkControl {
            rows: [MkRow::GREEDY; MAX_BATCH],
            n_stop: stop_ids.len() as i32,
            stop_ids: [0; MAX_STOP],
        };
        c.rows[..rows.len()].copy_from_slice(rows);
        for (d, &t) in c.stop_ids.iter_mut().zip(stop_ids) {
            *d = i32::try_from(t).map_err(|_| ControlError::StopId(t))?;
        }
        Ok(c)
    }

    /// Batch row `b`'s Philox row.
    pub fn row(&self, b: usize) -> u32 {
        self.rows[b].row()
    }

    /// Byte offset of batch row `b`'s [`MkRow`] in the device struct: where the host writes
    /// [`MkRow::as_bytes`] to change one row between launches.
    pub fn row_offset(b: usize) -> Result<usize, ControlError> {
        if b >= MAX_BATCH {
            return Err(ControlError::Row(b));
        }
        Ok(std::mem::offset_of!(MkControl, rows) + b * MkRow::SIZE)
    }

    /// The struct's bytes as the device reads them (little-endian, the C layout, zero padding):
    /// what the host copies into the device's `MkControl`.
    pub fn as_bytes(&self) -> [u8; MkControl::SIZE] {
        use std::mem::offset_of;
        let mut out = [0u8; MkControl::SIZE];
        let mut put = |at: usize, b: &[u8]| out[at..at + b.len()].copy_from_slice(b);
        for (i, r) in self.rows.iter().enumerate() {
            put(offset_of!(MkControl, rows) + MkRow::SIZE * i, &r.as_bytes());
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

    /// Every `static_assert(<lhs> == <n>, ...)` of the header, as (lhs, n), and every
    /// `KILN_OFFSET_IS(T, f, n);` (the offset check that compiles where NVRTC has
    /// `__builtin_offsetof`) as ("__builtin_offsetof(T, f)", n).
    fn asserts() -> Vec<(String, usize)> {
        let plain = HEADER
            .lines()
            .filter_map(|l| l.trim().strip_prefix("static_assert("))
            .map(|l| {
                let (lhs, rest) = l.split_once(" == ").unwrap();
                let n = rest.split(',').next().unwrap().trim().parse().unwrap();
                (lhs.to_string(), n)
            });
        let offsets = HEADER
            .lines()
            .filter_map(|l| l.trim().strip_prefix("KILN_OFFSET_IS("))
            .filter_map(|l| l.strip_suffix(");"))
            .map(|l| {
                let parts: Vec<&str> = l.split(", ").collect();
                assert_eq!(parts.len(), 3, "KILN_OFFSET_IS({l})");
                let lhs = format!("__builtin_offsetof({}, {})", parts[0], parts[1]);
                (lhs, parts[2].parse().unwrap())
            });
        plain.chain(offsets).collect()
    }

    #[test]
    fn layout_matches_the_static_asserts_of_sample_cuh() {
        assert_eq!(define("MK_MAX_BATCH"), MAX_BATCH);
        assert_eq!(define("MK_MAX_STOP"), MAX_STOP);
        assert_eq!(define("MK_RING"), RING);
        let fields = [
            ("MkRow", "temperature", offset_of!(MkRow, temperature)),
            ("MkRow", "top_k", offset_of!(MkRow, top_k)),
            ("MkRow", "top_p", offset_of!(MkRow, top_p)),
            ("MkRow", "min_p", offset_of!(MkRow, min_p)),
            ("MkRow", "seed", offset_of!(MkRow, seed)),
            ("MkRow", "row_id", offset_of!(MkRow, row_id)),
            ("MkRow", "pad", offset_of!(MkRow, pad)),
            ("MkControl", "rows", offset_of!(MkControl, rows)),
            ("MkControl", "n_stop", offset_of!(MkControl, n_stop)),
            ("MkControl", "stop_ids", offset_of!(MkControl, stop_ids)),
        ];
        let a = asserts();
        assert_eq!(a.len(), fields.len() + 4, "{a:?}");
        for (lhs, n) in &a {
            let rust = match lhs.as_str() {
                "sizeof(MkRow)" => size_of::<MkRow>(),
                "alignof(MkRow)" => align_of::<MkRow>(),
                "sizeof(MkControl)" => size_of::<MkControl>(),
                "alignof(MkControl)" => align_of::<MkControl>(),
                _ => {
                    let (st, f) = lhs
                        .strip_prefix("__builtin_offsetof(")
                        .and_then(|f| f.strip_suffix(')'))
                        .and_then(|f| f.split_once(", "))
                        .unwrap_or_else(|| panic!("unexpected static_assert on {lhs}"));
                    fields
                        .iter()
                        .find(|(s, name, _)| *s == st && *name == f)
                        .unwrap_or_else(|| panic!("no mirror of {st}.{f}"))
                        .2
                }
            };
            assert_eq!(rust, *n, "{lhs}");
        }
        assert_eq!((MkRow::SIZE, MkControl::SIZE), (32, 328));
    }

    #[test]
    fn new_maps_options_to_the_device_encoding_and_bytes_follow_the_layout() {
        let r = MkRow::new(0.7, Some(40), None, Some(0.05), 0x0102_0304_0506_0708, 3).unwrap();
        let r2 = MkRow::new(1.5, None, Some(0.9), None, 9, u32::MAX).unwrap();
        assert_eq!((r.top_k, r.top_p, r.min_p), (40, 1.0, 0.05));
        let c = MkControl::new(&[r, r2], &[2, 7]).unwrap();
        assert_eq!(c.n_stop, 2);
        assert_eq!((c.row(0), c.row(1)), (3, u32::MAX));
        assert_eq!(c.rows[2..], [MkRow::GREEDY; 6]);
        let b = c.as_bytes();
        assert_eq!(b[0..4], 0.7f32.to_le_bytes());
        assert_eq!(b[4..8], 40i32.to_le_bytes());
        assert_eq!(b[8..12], 1.0f32.to_le_bytes());
        assert_eq!(b[12..16], 0.05f32.to_le_bytes());
        assert_eq!(b[16..24], 0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(b[24..28], 3i32.to_le_bytes());
        assert_eq!(b[28..32], [0; 4], "MkRow.pad");
        let at = MkControl::row_offset(1).unwrap();
        assert_eq!(at, 32);
        assert_eq!(b[at..at + 32], r2.as_bytes());
        assert_eq!(b[at..at + 4], 1.5f32.to_le_bytes());
        assert_eq!(b[at + 8..at + 12], 0.9f32.to_le_bytes());
        assert_eq!(b[at + 24..at + 28], [0xff; 4]);
        // Unused rows are greedy with top-p off.
        assert_eq!(b[64..68], 0f32.to_le_bytes());
        assert_eq!(b[72..76], 1.0f32.to_le_bytes());
        assert_eq!(b[256..260], 2i32.to_le_bytes());
        assert_eq!(b[260..264], 2i32.to_le_bytes());
        assert_eq!(b[264..268], 7i32.to_le_bytes());
        assert_eq!(b[324..328], [0; 4], "tail padding");
        let greedy = MkRow::new(0.0, None, Some(1.0), None, 0, 0).unwrap();
        assert_eq!(greedy, MkRow::GREEDY);
        let huge = MkRow::new(1.0, Some(usize::MAX), None, None, 0, 0).unwrap();
        assert_eq!(huge.top_k, i32::MAX);
        assert_eq!(ring_words(8), 64 * 10);
        assert_eq!(MkControl::row_offset(7), Ok(224));
        assert_eq!(MkControl::row_offset(8), Err(ControlError::Row(8)));
    }

    #[test]
    fn bad_values_are_named() {
        let new = |t: f32, k, p, m| MkRow::new(t, k, p, m, 0, 0);
        assert_eq!(
            new(-1.0, None, None, None),
            Err(ControlError::Temperature(-1.0))
        );
        assert!(matches!(
            new(f32::NAN, None, None, None),
            Err(ControlError::Temperature(_))
        ));
        assert_eq!(new(1.0, Some(0), None, None), Err(ControlError::TopK));
        assert_eq!(
            new(1.0, None, Some(0.0), None),
            Err(ControlError::TopP(0.0))
        );
        assert_eq!(
            new(1.0, None, Some(1.5), None),
            Err(ControlError::TopP(1.5))
        );
        assert_eq!(
            new(1.0, None, None, Some(-0.1)),
            Err(ControlError::MinP(-0.1))
        );
        let g = MkRow::GREEDY;
        assert_eq!(MkControl::new(&[g; 9], &[]), Err(ControlError::Rows(9)));
        assert_eq!(
            MkControl::new(&[], &[1; 17]),
            Err(ControlError::StopIds(17))
        );
        assert_eq!(
            MkControl::new(&[], &[1 << 31]),
            Err(ControlError::StopId(1 << 31))
        );
        let e = MkControl::new(&[], &[1; 17]).unwrap_err();
        assert!(e.to_string().contains("17 stop ids"), "{e}");
    }
}
