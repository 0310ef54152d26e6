//! Every format against ggml's reference: `tests/fixtures/quant/blocks.gguf` holds random blocks
//! of each format and their dequantization by gguf-py (bit-identical to ggml's C), written by
//! `scripts/make_quant_fixtures.py`.

use std::path::Path;

use super::*;
use crate::files::gguf::{GgmlType, GgufFile};
use crate::model::{DType, Tensor};

fn fixture() -> GgufFile {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant/blocks.gguf");
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn tensor(file: &GgufFile, name: &str) -> Tensor {
    let info = file
        .tensor(name)
        .unwrap_or_else(|| panic!("fixture has no tensor {name}"));
    file.load_tensor(info, name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The first differing element, if any, compared bit for bit.
fn first_difference(got: &[f32], want: &[f32]) -> Option<(usize, f32, f32)> {
    if got.len() != want.len() {
        return Some((got.len().min(want.len()), f32::NAN, f32::NAN));
    }
    got.iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
        .map(|i| (i, got[i], want[i]))
}

#[test]
fn every_format_dequantizes_bit_identically_to_ggml() {
    let file = fixture();
    for kind in QuantKind::ALL {
        let blocks = tensor(&file, &format!("{}.blocks", kind.name()));
        let want = tensor(&file, &format!("{}.f32", kind.name())).to_f32_vec();
        assert_eq!(blocks.dtype, DType::from_quant(kind), "{}", kind.name());
        assert!(want.len() >= 4 * kind.block_elems(), "{}", kind.name());

        // The parallel whole-tensor path and the serial row path.
        let got = blocks.to_f32_vec();
        if let Some((i, g, w)) = first_difference(&got, &want) {
            panic!(
                "{} element {i}: {g:e} ({:#x}), ggml {w:e}",
                kind.name(),
                g.to_bits()
            );
        }
        let mut row = vec![f32::NAN; want.len()];
        dequantize_row(kind, blocks.raw(), &mut row);
        assert!(first_difference(&row, &want).is_none(), "{}", kind.name());
    }
}

#[test]
fn fixture_values_are_varied() {
    // Guards the comparison above against a degenerate fixture (all zeros, one repeated value).
    let file = fixture();
    for kind in QuantKind::ALL {
        let want = tensor(&file, &format!("{}.f32", kind.name())).to_f32_vec();
        let mut distinct: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > want.len() / 8, "{}", kind.name());
        assert!(want.iter().all(|v| v.is_finite()), "{}", kind.name());
    }
}

#[test]
fn block_geometry_matches_ggml_type_table() {
    for kind in QuantKind::ALL {
        let ggml = (0..64)
            .map(GgmlType)
            .find(|t| t.name() == Some(kind.name()))
            .unwrap_or_else(|| panic!("ggml has no type {}", kind.name()));
        assert_eq!(
            ggml.block(),
            Some((kind.block_elems() as u64, kind.block_bytes() as u64)),
            "{}",
            kind.name()
        );
        with_format!(kind, F => {
            assert_eq!((F::KIND, F::ELEMS, F::BYTES), (kind, kind.block_elems(), kind.block_bytes()));
        });
        assert_eq!(
            kind.bytes_for(kind.block_elems() * 3),
            Some(3 * kind.block_bytes())
        );
        assert_eq!(kind.bytes_for(kind.block_elems() + 1), None);
    }
}
