//! Every kernel at every SIMD level this CPU supports against an f64 reference, for dense and
//! every quantized format, with row, column and token counts that are not multiples of the tiles.

use super::grouped::Layout;
use super::*;

/// A xorshift64 stream from `seed`: the random bits every generator here draws from.
fn xorshift(seed: u64) -> impl Iterator<Item = u64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    std::iter::repeat_with(move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    })
}

fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    xorshift(seed)
        .take(n)
        .map(|s| ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        .collect()
}

/// The matrix's weights as f64 (quantized blocks through the scalar reference dequantization).
fn weights_f64(w: &PackedMatrix) -> Vec<f64> {
    data_f64(&w.data, w.rows, w.cols)
}

fn data_f64(data: &WeightData, rows: usize, cols: usize) -> Vec<f64> {
    match data {
        WeightData::F32(v) => v.iter().map(|&x| x as f64).collect(),
        WeightData::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
        WeightData::Quant { kind, blocks } => {
            let mut f = vec![0f32; rows * cols];
            quant::dequantize_row(*kind, blocks, &mut f);
            f.into_iter().map(|x| x as f64).collect()
        }
        WeightData::Parts(parts) => parts
            .iter()
            .flat_map(|p| data_f64(&p.data, p.rows, cols))
            .collect(),
        WeightData::Grouped(m) => (0..rows)
            .flat_map(|n| {
                let mut f = vec![0f32; cols];
                m.row_f32(n, &mut f);
                f
            })
            .map(|x| x as f64)
            .collect(),
        WeightData::Interleaved(m) => (0..rows)
            .flat_map(|n| {
                let mut f = vec![0f32; cols];
                m.row_f32(n, &mut f);
                f
            })
            .map(|x| x as f64)
            .collect(),
    }
}

/// `rows × cols` random blocks of `kind`: every quant value occurs, scales and mins vary in
/// magnitude and sign (as real ggml files have them).
fn rand_blocks(kind: QuantKind, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let bb = kind.block_bytes();
    let nb = rows * cols / kind.block_elems();
    let r = rand_vec(nb * bb, seed);
    let mut blocks: Vec<u8> = r.iter().map(|&v| ((v + 1.0) * 127.99) as u8).collect();
    for (b, c) in blocks.chunks_exact_mut(bb).enumerate() {
        let d = 0.002 + 0.05 * (r[b * bb] + 1.0);
        let m = -8.0 * d * (r[b * bb + 1] + 0.5);
        if kind == QuantKind::Q8_K {
            c[..4].copy_from_slice(&d.to_le_bytes());
        }
        for (&at, v) in f16_fields(kind).iter().zip([d, m]) {
            c[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    blocks
}

/// Byte offsets of a block's f16 scale (and min) fields, which random bytes must not fill.
fn f16_fields(kind: QuantKind) -> &'static [usize] {
    match kind {
        QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q5_0 => &[0],
        QuantKind::Q4_1 | QuantKind::Q5_1 | QuantKind::Q4_K | QuantKind::Q5_K => &[0, 2],
        QuantKind::Q2_K => &[80, 82],
        QuantKind::Q3_K => &[108],
        QuantKind::Q6_K => &[208],
        QuantKind::Q8_K => &[],
    }
}

fn quant_matrix(kind: QuantKind, rows: usize, cols: usize, bias: bool, seed: u64) -> PackedMatrix {
    PackedMatrix {
        rows,
        cols,
        data: WeightData::Quant {
            kind,
            blocks: rand_blocks(kind, rows, cols, seed).into(),
        },
        bias: bias.then(|| rand_vec(rows, seed + 1)),
    }
}

/// `w`'s blocks regrouped sixteen rows to a group, as engines hold them for the grouped
/// kernels.
fn regrouped(w: PackedMatrix) -> PackedMatrix {
    PackedMatrix {
        data: w.data.grouped(w.rows, w.cols),
        ..w
    }
}

/// Run one configuration at `level` and compare against an f64 reference.
#[allow(clippy::too_many_arguments)]
fn check(
    level: Level,
    bf: bool,
    rows: usize,
    cols: usize,
    tokens: usize,
    bias: bool,
    acc: bool,
    par: bool,
) {
    let seed = (rows * 1000 + cols * 10 + tokens) as u64;
    let wv = rand_vec(rows * cols, seed);
    let data = if bf {
        WeightData::BF16(wv.iter().map(|&v| bf16::from_f32(v)).collect())
    } else {
        WeightData::F32(wv.into())
    };
    let w = PackedMatrix {
        rows,
        cols,
        data,
        bias: bias.then(|| rand_vec(rows, seed + 1)),
    };
    if let Err(e) = run_and_compare(level, &w, tokens, acc, par, seed) {
        panic!("{level:?} bf16={bf} {rows}x{cols} tokens={tokens} bias={bias} acc={acc}: {e}");
    }
}

/// Multiply `w` by random strided activations at `level` (whole-pool split or one call over
/// all rows) and compare against the f64 reference.
fn run_and_compare(
    level: Level,
    w: &PackedMatrix,
    tokens: usize,
    acc: bool,
    par: bool,
    seed: u64,
) -> Result<(), String> {
    let (rows, cols) = (w.rows, w.cols);
    let (ldx, ldo) = (cols + 3, rows + 5);
    let x = rand_vec((tokens - 1) * ldx + cols, seed + 2);
    let out0 = rand_vec((tokens - 1) * ldo + rows + 2, seed + 3);
    let mut out = out0.clone();
    if par {
        matmul_at(level, w, &x, ldx, tokens, &mut out, ldo, acc);
    } else {
        unsafe {
            matmul_rows_at(
                level,
                w,
                &x,
                ldx,
                tokens,
                0..rows,
                out.as_mut_ptr(),
                ldo,
                acc,
            )
        };
    }
    compare(w, &x, ldx, tokens, &out0, &out, ldo, acc)
}

/// Check `out` (computed from `out0`) against an f64 reference; error scaled by Σ|terms|.
#[allow(clippy::too_many_arguments)]
fn compare(
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    out0: &[f32],
    out: &[f32],
    ldo: usize,
    acc: bool,
) -> Result<(), String> {
    compare_within(w, x, ldx, tokens, out0, out, ldo, acc, 1e-5)
}

/// [`compare`] with the error bound `tol · Σ|terms|`.
#[allow(clippy::too_many_arguments)]
fn compare_within(
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    out0: &[f32],
    out: &[f32],
    ldo: usize,
    acc: bool,
    tol: f64,
) -> Result<(), String> {
    let (rows, cols) = (w.rows, w.cols);
    let wf = weights_f64(w);
    for (i, (&o, &o0)) in out.iter().zip(out0).enumerate() {
        let (t, n) = (i / ldo, i % ldo);
        if t >= tokens || n >= rows {
            if o.to_bits() != o0.to_bits() {
                return Err(format!("wrote outside the output at {i}"));
            }
            continue;
        }
        let mut want = if acc { o0 as f64 } else { 0.0 };
        let mut mag = want.abs();
        if let Some(b) = &w.bias {
            want += b[n] as f64;
            mag += b[n].abs() as f64;
        }
        for k in 0..cols {
            let p = wf[n * cols + k] * x[t * ldx + k] as f64;
            want += p;
            mag += p.abs();
        }
        let err = (o as f64 - want).abs();
        // A NaN output (or reference) fails too.
        if err.is_nan() || err > tol * mag {
            return Err(format!(
                "out[{t},{n}] = {o}, want {want} (err {err:e}, mag {mag})"
            ));
        }
    }
    Ok(())
}

#[test]
fn every_level_matches_f64_reference() {
    let rows_set = [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 33, 70];
    let cols_set = [1, 2, 7, 15, 16, 17, 31, 32, 33, 47, 64, 100, 129, 300];
    for level in simd::available_levels() {
        for bf in [false, true] {
            for &rows in &rows_set {
                for &cols in &cols_set {
                    for tokens in (1..=9).chain([12, 13, 16, 17]) {
                        let v = rows + cols + tokens;
                        check(level, bf, rows, cols, tokens, v % 2 == 0, v % 3 != 0, false);
                    }
                }
            }
        }
    }
}

#[test]
fn parallel_split_matches_reference() {
    for level in simd::available_levels() {
        for bf in [false, true] {
            for (rows, cols, tokens) in [
                (70, 300, 1),
                (257, 96, 1),
                (150, 65, 5),
                (64, 33, 12),
                (150, 65, 30),
            ] {
                check(level, bf, rows, cols, tokens, true, true, true);
                check(level, bf, rows, cols, tokens, false, false, true);
            }
        }
    }
}

/// Calls of one to [`TEAM_TOKENS`] tokens inside a forward step, split into one part a thread
/// of the step's team (each part rounding its own activations), give the bits of the same calls
/// in rayon loops: dense and grouped weights, exact and rounded numerics, 2 threads.
#[test]
fn few_token_calls_in_a_step_give_the_bits_of_rayon_loops() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("a 2-thread pool");
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let mut cases = Vec::new();
    for (rows, cols) in [(16, 64), (100, 96), (576, 576), (960, 576), (3072, 64)] {
        let seed = (rows + cols) as u64;
        cases.push((
            "f32",
            PackedMatrix {
                rows,
                cols,
                data: WeightData::F32(rand_vec(rows * cols, seed).into()),
                bias: None,
            },
        ));
        for kind in [QuantKind::Q4_1, QuantKind::Q8_0, QuantKind::Q4_K] {
            if kind == QuantKind::Q4_K && cols % 256 != 0 {
                continue;
            }
            let q = quant_matrix(kind, rows, cols, true, seed + 1);
            cases.push((
                "grouped",
                PackedMatrix {
                    data: q.data.grouped(rows, cols),
                    ..q
                },
            ));
        }
    }
    let mut in_parts = 0;
    for (name, w) in &cases {
        for tokens in [1, 2, TEAM_TOKENS] {
            let ldx = w.cols + 3;
            let x = rand_vec((tokens - 1) * ldx + w.cols, w.rows as u64 + 5);
            let out0 = rand_vec(tokens * w.rows, 9);
            for numerics in [Numerics::Exact, Numerics::Int24, Numerics::Int16] {
                for acc in [false, true] {
                    let what = format!(
                        "{name} {}x{} x{tokens} {numerics:?} acc {acc}",
                        w.rows, w.cols
                    );
                    let mut looped = out0.clone();
                    pool.install(|| matmul(numerics, w, &x, ldx, tokens, &mut looped, w.rows, acc));
                    let mut parted = out0.clone();
                    pool.install(|| {
                        crate::backend::cpu::keep_awake::during(2, || {
                            if crate::backend::cpu::keep_awake::keepers_present(2) {
                                in_parts += 1;
                            }
                            matmul(numerics, w, &x, ldx, tokens, &mut parted, w.rows, acc)
                        })
                    });
                    assert_eq!(bits(&parted), bits(&looped), "{what}");
                }
            }
        }
    }
    if in_parts == 0 {
        println!("SKIPPED (team parts): the keepers never arrived; every call ran in rayon loops");
    }
}

/// `ranges` cover rows `0..rows` once, in order, each starting on a multiple of `unit`.
fn assert_cover(ranges: &[std::ops::Range<usize>], rows: usize, unit: usize, what: &str) {
    assert_eq!(ranges[0].start, 0, "{what}");
    assert_eq!(ranges[ranges.len() - 1].end, rows, "{what}");
    for pair in ranges.windows(2) {
        assert_eq!(pair[0].end, pair[1].start, "{what}");
    }
    assert!(ranges.iter().all(|r| r.start % unit == 0), "{what}");
}

/// The parallel split: tasks cover every row once, in order, start on the kernels' unit (4 rows
/// for one-token dense GEMVs, 16 for grouped weights and few-token calls, the panel above 16
/// tokens), number at most four per thread, and differ by at most one unit, so that the two
/// halves rayon gives two threads are as even as the units allow.
#[test]
fn tasks_split_rows_evenly_on_kernel_units() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("a 2-thread pool");
    pool.install(|| {
        let level = simd::level();
        for rows in [1, 3, 16, 17, 64, 100, 576, 960, 3072, 49152] {
            let dense = PackedMatrix {
                rows,
                cols: 32,
                data: WeightData::F32(vec![0.0; rows * 32].into()),
                bias: None,
            };
            let q = quant_matrix(QuantKind::Q4_1, rows, 32, false, 1);
            let grouped = PackedMatrix {
                data: q.data.grouped(rows, 32),
                ..q
            };
            for (w, name) in [(&dense, "dense"), (&grouped, "grouped")] {
                for tokens in [1, 4, 16, 17, 512] {
                    let unit = match (tokens, name) {
                        (1, "dense") => 4,
                        (1, _) => 16,
                        (t, _) => tile_rows(simd::clamp(level), t),
                    };
                    let tasks: Vec<_> = task_rows(level, w, tokens).iter().collect();
                    let what = format!("{name} {rows} rows, {tokens} tokens: {tasks:?}");
                    // Two tasks a thread in one-token calls, four in others.
                    let most = if tokens == 1 { 4 } else { 8 };
                    assert!(!tasks.is_empty() && tasks.len() <= most, "{what}");
                    if rows >= 3072 {
                        assert_eq!(tasks.len(), most, "{what}");
                    }
                    assert_cover(&tasks, rows, unit, &what);
                    // Counted in units (the last one may be part of a unit).
                    let units = tasks.iter().map(|r| r.len().div_ceil(unit));
                    let (lo, hi) = (units.clone().min(), units.max());
                    assert!(hi.unwrap_or(0) - lo.unwrap_or(0) <= 1, "{what}");
                }
            }
        }
    });
}

/// A team call's parts cover every row once, in order, on unit boundaries; part 0 takes the
/// caller's lead (in whole units, where the call is large enough for it), the others even
/// shares; without a lead every part takes an even share.
#[test]
fn team_parts_give_the_caller_its_lead() {
    for (units, unit_bytes, members) in [
        (36, 5760, 2),
        (192, 5760, 2),
        (36, 15360, 2),
        (3072, 9216, 2),
        (56, 43776, 2),
        (8, 5760, 2),
        (3, 100, 3),
        (100, 1000, 4),
        (2, 1 << 20, 2),
    ] {
        let rows = units * 16 - 5;
        let tasks = TaskRows {
            tasks: 4,
            units,
            unit: 16,
            rows,
        };
        let parts = TeamRows::new(tasks, members, units * unit_bytes, CALLER_LEAD_BYTES);
        let even = TeamRows::new(tasks, members, units * unit_bytes, 0);
        for i in 0..members {
            let r = even.rows(i);
            let n = r.len().div_ceil(16);
            assert!(
                n == units / members || n == units.div_ceil(members),
                "no lead: part {i} {r:?} of {units} units"
            );
        }
        let all: Vec<_> = (0..members).map(|i| parts.rows(i)).collect();
        let what = format!("{units} units of {unit_bytes} bytes, {members} parts: {all:?}");
        assert_cover(&all, rows, 16, &what);
        let lead = (CALLER_LEAD_BYTES + unit_bytes / 2) / unit_bytes;
        let lead = if units > 8 * lead { lead } else { 0 };
        assert_eq!(all[0].len(), (units / members + lead) * 16, "{what}");
        let others: Vec<usize> = all[1..].iter().map(|r| r.len().div_ceil(16)).collect();
        let (lo, hi) = (others.iter().min().unwrap(), others.iter().max().unwrap());
        assert!(hi - lo <= 1, "{what}");
        if (units, unit_bytes) == (36, 5760) {
            // Two groups of 16 rows: 11.5 KB, the nearest to the lead.
            assert_eq!(all[0], 0..320, "{what}");
        }
    }
}

/// Rows, columns and token counts to test `kind` with: rows and tokens around the kernels' 4-row
/// and 4/2-token tiles, columns of one and several blocks (fewer cases for the 256-element
/// formats, whose blocks are 8 times longer).
fn quant_shapes(kind: QuantKind) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let n = kind.block_elems();
    if n == 32 {
        let rows = vec![1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 33, 70];
        (
            rows,
            vec![32, 64, 96, 160, 576],
            (1..=9).chain([12, 13, 16, 17]).collect(),
        )
    } else {
        (
            vec![1, 3, 4, 5, 17, 33],
            vec![n, 3 * n, 5 * n],
            vec![1, 2, 3, 5, 9],
        )
    }
}

#[test]
fn quantized_every_level_matches_f64_reference() {
    for level in simd::available_levels() {
        for kind in QuantKind::ALL {
            let (rows_set, cols_set, tokens_set) = quant_shapes(kind);
            for &rows in &rows_set {
                for &cols in &cols_set {
                    for &tokens in &tokens_set {
                        let v = rows + cols + tokens;
                        let seed = (rows * 1000 + cols * 10 + tokens) as u64;
                        let w = quant_matrix(kind, rows, cols, v % 2 == 0, seed);
                        if let Err(e) = run_and_compare(level, &w, tokens, v % 3 != 0, false, seed)
                        {
                            panic!("{level:?} {kind:?} {rows}x{cols} tokens={tokens}: {e}");
                        }
                        if groupable(kind) {
                            let g = regrouped(w);
                            if let Err(e) =
                                run_and_compare(level, &g, tokens, v % 3 != 0, false, seed)
                            {
                                panic!(
                                    "{level:?} grouped {kind:?} {rows}x{cols} tokens={tokens}: {e}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn quantized_parallel_split_matches_reference() {
    for level in simd::available_levels() {
        for kind in QuantKind::ALL {
            for (rows, blocks, tokens) in [
                (70, 10, 1),
                (257, 3, 1),
                (150, 2, 5),
                (64, 1, 12),
                (150, 18, 30),
            ] {
                let cols = blocks * kind.block_elems();
                for (bias, acc) in [(true, true), (false, false)] {
                    let w = quant_matrix(kind, rows, cols, bias, rows as u64);
                    if let Err(e) = run_and_compare(level, &w, tokens, acc, true, 3) {
                        panic!("{level:?} {kind:?} {rows}x{cols} tokens={tokens}: {e}");
                    }
                    if groupable(kind) {
                        let g = regrouped(w);
                        if let Err(e) = run_and_compare(level, &g, tokens, acc, true, 3) {
                            panic!("{level:?} grouped {kind:?} {rows}x{cols} tokens={tokens}: {e}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn quantized_tiles_dequantize_bit_exactly() {
    for level in simd::available_levels() {
        for kind in QuantKind::ALL {
            let (rows, cols) = (3, 5 * kind.block_elems());
            let blocks = rand_blocks(kind, rows, cols, 5);
            let mut want = vec![0f32; rows * cols];
            quant::dequantize_row(kind, &blocks, &mut want);
            let mut got = vec![f32::NAN; rows * cols];
            dequantize_rows(level, kind, &blocks, &mut got);
            let same = same_bits(&want, &got);
            assert!(same, "{level:?} {kind:?}");
        }
    }
}

#[test]
fn quantized_shapes_are_checked() {
    let w = WeightData::Quant {
        kind: QuantKind::Q4_1,
        blocks: vec![0; 2 * 20].into(),
    };
    assert!(w.check_shape(2, 32).is_ok());
    assert!(w.check_shape(3, 32).is_err(), "byte count must match rows");
    assert!(w.check_shape(2, 16).unwrap_err().contains("not whole"));
    assert!(WeightData::F32(vec![0.0; 3].into())
        .check_shape(1, 3)
        .is_ok());
}

#[test]
fn comparison_catches_a_dropped_tail() {
    // A kernel that skipped the last column (a dropped k tail) must fail the comparison.
    let (rows, cols, tokens) = (5, 33, 3);
    let wv = rand_vec(rows * cols, 9);
    let mut dropped = wv.clone();
    for n in 0..rows {
        dropped[n * cols + cols - 1] = 0.0;
    }
    let good = PackedMatrix {
        rows,
        cols,
        data: WeightData::F32(wv.into()),
        bias: None,
    };
    let bad = PackedMatrix {
        rows,
        cols,
        data: WeightData::F32(dropped.into()),
        bias: None,
    };
    let x = rand_vec(tokens * cols, 10);
    let out0 = vec![0f32; tokens * rows];
    let mut out = out0.clone();
    matmul_at(Level::Scalar, &bad, &x, cols, tokens, &mut out, rows, false);
    assert!(compare(&good, &x, cols, tokens, &out0, &out, rows, false).is_err());
    matmul_at(
        Level::Scalar,
        &good,
        &x,
        cols,
        tokens,
        &mut out,
        rows,
        false,
    );
    assert!(compare(&good, &x, cols, tokens, &out0, &out, rows, false).is_ok());
}

#[test]
#[should_panic(expected = "input too short")]
fn short_input_is_rejected() {
    let w = PackedMatrix {
        rows: 1,
        cols: 17,
        data: WeightData::F32(vec![1.0; 17].into()),
        bias: None,
    };
    let mut out = vec![0.0f32; 1];
    matmul(Numerics::Exact, &w, &[1.0; 16], 16, 1, &mut out, 1, false);
}

/// A token's result does not depend on how many tokens share the call, within each kernel's
/// range. AVX2, and AVX-512 above 16 tokens: every token takes the packed-panel tile, one FMA
/// chain per output whatever the tile width, so each equals itself in another call of that range
/// (two tokens on AVX2, 17 on AVX-512). AVX-512 up to 16 tokens: the first
/// `tokens − tokens mod 4` go through register tiles of any width, which all sum in one order,
/// and the rest through the GEMV, as a one-token call does (with 6-token tiles covering tokens 4
/// and 5 of a 6-token call, those differed from the same tokens alone).
#[test]
fn tile_widths_round_like_the_narrowest_tile() {
    // Several panels, the last one partial, and calls of hundreds of tokens: every token's
    // outputs as in a call of two (AVX2) or seventeen (AVX-512) tokens.
    let shapes: [(usize, usize, &[usize]); 3] = [
        (8, 576, &[5, 6, 7, 10, 17, 30]),
        (40, 576, &[100, 181]),
        (150, 2048, &[30, 53]),
    ];
    for (rows, cols, token_counts) in shapes {
        tile_widths_round_alike(rows, cols, token_counts);
    }
}

fn tile_widths_round_alike(rows: usize, cols: usize, token_counts: &[usize]) {
    // f32 weights: a one-token call takes the same dense GEMV as the tail (quantized weights
    // take the block GEMV alone).
    let w = PackedMatrix {
        rows,
        cols,
        data: WeightData::F32(rand_vec(rows * cols, 11).into()),
        bias: None,
    };
    for level in simd::available_levels() {
        for &tokens in token_counts {
            let x = rand_vec(tokens * cols, tokens as u64);
            let mut all = vec![0f32; tokens * rows];
            matmul_at(level, &w, &x, cols, tokens, &mut all, rows, false);
            // The narrowest tile's width (one token at a time at the scalar level).
            let avx512 = matches!(simd::clamp(level), Level::Avx512 | Level::Avx512Bf16);
            let base = if avx512 { 4 } else { 1 };
            let tiled = tokens - tokens % base;
            for t in 0..tokens {
                let (first, n) = if avx512 && tokens > 16 {
                    // Panels: in a call of 17 tokens.
                    (t.min(tokens - 17), 17)
                } else if simd::clamp(level) == Level::Avx2 {
                    // Panels: in a call of two tokens.
                    (t.min(tokens - 2), 2)
                } else if t >= tiled {
                    // Alone for the GEMV tokens.
                    (t, 1)
                } else {
                    // In a call of one narrowest tile.
                    (t - t % base, base)
                };
                let mut part = vec![0f32; n * rows];
                matmul_at(
                    level,
                    &w,
                    &x[first * cols..],
                    cols,
                    n,
                    &mut part,
                    rows,
                    false,
                );
                let want = &part[(t - first) * rows..(t - first + 1) * rows];
                let got = &all[t * rows..(t + 1) * rows];
                let same = same_bits(want, got);
                assert!(same, "{level:?} token {t} of {tokens}: {got:?} vs {want:?}");
            }
        }
    }
}

/// The weights the panel tests multiply by (seeds `seed..seed + 4`): f32 with a bias, the same
/// values as bf16, Q4_1 with a bias and Q8_0 (the last two through dequantized tiles).
fn panel_matrices(rows: usize, cols: usize, seed: u64) -> Vec<PackedMatrix> {
    let f32_rows = rand_vec(rows * cols, seed);
    vec![
        PackedMatrix {
            rows,
            cols,
            data: WeightData::F32(f32_rows.clone().into()),
            bias: Some(rand_vec(rows, seed + 1)),
        },
        PackedMatrix {
            rows,
            cols,
            data: WeightData::BF16(f32_rows.iter().map(|&v| bf16::from_f32(v)).collect()),
            bias: None,
        },
        quant_matrix(QuantKind::Q4_1, rows, cols, true, seed + 2),
        quant_matrix(QuantKind::Q8_0, rows, cols, false, seed + 3),
    ]
}

/// Whether two results hold the same bits, element for element (and as many elements).
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The AVX-512 panels (32 outputs × 12 tokens, calls of more than 16 tokens) sum every output as
/// the AVX2 panels (16 × 6) do, so such a call gives the same bits on either ISA: f32, bf16 and
/// quantized weights (dequantized tiles), row counts that leave partial panels, token counts
/// that leave several tail widths, with bias and accumulating into the output.
#[test]
fn avx512_panels_round_like_avx2_panels() {
    let levels = simd::available_levels();
    if !levels.contains(&Level::Avx512) {
        println!("skipped: this CPU has no AVX-512");
        return;
    }
    let (rows, cols) = (70, 320);
    let matrices = panel_matrices(rows, cols, 21);
    for (i, w) in matrices.iter().enumerate() {
        for tokens in [17, 23, 24, 35, 40] {
            let x = rand_vec(tokens * cols, 30 + tokens as u64);
            let start = rand_vec(tokens * rows, 31);
            let mut on_avx2 = start.clone();
            let mut on_avx512 = start.clone();
            matmul_at(Level::Avx2, w, &x, cols, tokens, &mut on_avx2, rows, true);
            matmul_at(
                Level::Avx512,
                w,
                &x,
                cols,
                tokens,
                &mut on_avx512,
                rows,
                true,
            );
            let same = same_bits(&on_avx2, &on_avx512);
            assert!(same, "matrix {i} with {tokens} tokens");
        }
    }
}

/// On AVX2, calls of [`avx2_panel::PACK_MIN_TOKENS`] tokens or more read their activations
/// packed tile by tile, and every call passes over several panels at a time: each token's
/// outputs are bit for bit those of calls too short to pack (17 to 23 tokens, which also keep
/// grouped weights off their few-token kernels), for f32, bf16, quantized and grouped weights,
/// with partial panels and panel groups, bias, accumulation, and the split across threads.
#[test]
fn packed_tokens_round_like_short_calls() {
    if !simd::available_levels().contains(&Level::Avx2) {
        println!("skipped: this CPU has no AVX2");
        return;
    }
    // 150 rows: nine whole panels and six rows; at 576 columns four panels a pass.
    let (rows, cols) = (150, 576);
    let mut matrices = panel_matrices(rows, cols, 41);
    matrices.push(regrouped(quant_matrix(
        QuantKind::Q4_1,
        rows,
        cols,
        false,
        45,
    )));
    // Token counts and the short calls' length, which divides them.
    for (tokens, short) in [(40, 20), (63, 21), (100, 20)] {
        assert!(short < avx2_panel::PACK_MIN_TOKENS && short > grouped::MAX_TOKENS);
        let x = rand_vec(tokens * cols, 50 + tokens as u64);
        let start = rand_vec(tokens * rows, 51);
        for (i, w) in matrices.iter().enumerate() {
            let mut whole = start.clone();
            matmul_at(Level::Avx2, w, &x, cols, tokens, &mut whole, rows, true);
            let mut parts = start.clone();
            for t in (0..tokens).step_by(short) {
                matmul_at(
                    Level::Avx2,
                    w,
                    &x[t * cols..],
                    cols,
                    short,
                    &mut parts[t * rows..],
                    rows,
                    true,
                );
            }
            let same = same_bits(&whole, &parts);
            assert!(same, "matrix {i} with {tokens} tokens");
        }
    }
}

/// Two to eight tokens on legacy, Q4_K and Q6_K blocks at the AVX2 and AVX-512 levels decode
/// each block once for all of them and round each token as its one-token GEMV: a batched decode
/// step of a few sequences gives each sequence bit for bit what it gets alone (with bias,
/// accumulating into the output, and over a split across threads).
#[test]
fn few_block_tokens_round_like_one_token_calls() {
    let levels: Vec<Level> = simd::available_levels()
        .into_iter()
        .filter(|&l| l >= Level::Avx2)
        .collect();
    if levels.is_empty() {
        println!("skipped: this CPU has no AVX2");
        return;
    }
    let rows = 70;
    for (kind, cols) in [
        (QuantKind::Q8_0, 320),
        (QuantKind::Q4_0, 320),
        (QuantKind::Q4_1, 320),
        (QuantKind::Q5_0, 320),
        (QuantKind::Q5_1, 320),
        (QuantKind::Q4_K, 512),
        (QuantKind::Q6_K, 512),
    ] {
        let w = quant_matrix(kind, rows, cols, true, 5);
        for (level, tokens) in levels.iter().flat_map(|&l| (2..=8).map(move |t| (l, t))) {
            let x = rand_vec(tokens * cols, 40 + tokens as u64);
            let start = rand_vec(tokens * rows, 7);
            let mut all = start.clone();
            matmul_at(level, &w, &x, cols, tokens, &mut all, rows, true);
            for t in 0..tokens {
                let mut one = start[t * rows..(t + 1) * rows].to_vec();
                matmul_at(level, &w, &x[t * cols..], cols, 1, &mut one, rows, true);
                let got = &all[t * rows..(t + 1) * rows];
                let same = same_bits(&one, got);
                assert!(same, "{level:?} {} token {t} of {tokens}", kind.name());
            }
        }
    }
}

// ----- Numerics::Int16 -----

/// The vectorised rounding of activations equals the scalar reference bit for bit: random
/// blocks, a zero block, subnormal and huge magnitudes, exact ties (rounded to even), and
/// blocks holding NaN or an infinity (scale NaN, quants 0).
#[test]
fn int16_rounding_matches_reference() {
    let mut x = rand_vec(32 * 12, 7);
    x[32..64].fill(0.0);
    for (i, v) in x[64..96].iter_mut().enumerate() {
        *v = (i as f32 - 16.0) * 1e-40;
    }
    for v in &mut x[96..128] {
        *v *= 3e38;
    }
    x[128] = 32767.0;
    for (i, v) in x[129..160].iter_mut().enumerate() {
        *v = i as f32 - 15.5;
    }
    x[170] = f32::NAN;
    x[200] = f32::INFINITY;
    x[240] = f32::NEG_INFINITY;
    let r = int16::quantize_ref(&x);
    assert_eq!(r.d[1], 0.0);
    assert!(r.d[5].is_nan() && r.d[6].is_nan() && r.d[7].is_nan());
    assert_eq!(&r.q[129..133], &[-16, -14, -14, -12], "ties round to even");
    let v = int16::quantize(&x);
    assert_eq!(v.q, r.q);
    let bits = |d: &[f32]| d.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&v.d), bits(&r.d));
    assert_eq!(bits(&v.sums), bits(&r.sums));
}

/// The formats with integer kernels.
const INT16_KINDS: [QuantKind; 7] = [
    QuantKind::Q8_0,
    QuantKind::Q4_0,
    QuantKind::Q4_1,
    QuantKind::Q5_0,
    QuantKind::Q5_1,
    QuantKind::Q4_K,
    QuantKind::Q6_K,
];

/// One-token GEMVs with [`Numerics::Int16`] compute the dequantized weights times the rounded
/// activations `d·q` (f64 reference, error within f32 rounding of the sums), stay within the
/// rounding's bound `Σ|w|·d/2` of the exact product, and differ from the exact kernels (so the
/// integer path ran), on every level that has it, split over the pool or not.
#[test]
fn int16_gemv_matches_rounded_reference() {
    let levels: Vec<Level> = simd::available_levels()
        .into_iter()
        .filter(|&l| l >= Level::Avx2)
        .collect();
    if levels.is_empty() {
        println!("SKIPPED: this CPU has no AVX2, so Numerics::Int16 runs the exact kernels");
        return;
    }
    for level in levels {
        for kind in INT16_KINDS {
            let n = kind.block_elems();
            for (rows, cols) in [
                (1, n),
                (3, 2 * n),
                (4, n),
                (7, 3 * n),
                (17, 5 * n),
                (70, 2 * n),
                (5, 12 * n),
            ] {
                let cols = if n == 32 { cols * 3 } else { cols };
                for (bias, acc, par) in [
                    (false, false, false),
                    (true, true, false),
                    (true, false, true),
                ] {
                    let seed = (rows * 1000 + cols) as u64;
                    let w = quant_matrix(kind, rows, cols, bias, seed);
                    let x = rand_vec(cols, seed + 2);
                    let out0 = rand_vec(rows + 3, seed + 3);
                    let mut out = out0.clone();
                    let mut exact = out0.clone();
                    if par {
                        matmul_with(level, Numerics::Int16, &w, &x, cols, 1, &mut out, rows, acc);
                    } else {
                        unsafe {
                            let p = out.as_mut_ptr();
                            matmul_rows_with(
                                level,
                                Numerics::Int16,
                                &w,
                                &x,
                                cols,
                                1,
                                0..rows,
                                p,
                                rows,
                                acc,
                            )
                        };
                    }
                    matmul_at(level, &w, &x, cols, 1, &mut exact, rows, acc);
                    let xr = int16::quantize_ref(&x);
                    let wf = weights_f64(&w);
                    let mut differs = false;
                    for r in 0..rows {
                        let base = if acc { out0[r] as f64 } else { 0.0 }
                            + w.bias.as_ref().map_or(0.0, |b| b[r] as f64);
                        let (mut want, mut mag, mut bound) = (base, base.abs(), 0.0);
                        for k in 0..cols {
                            let d = xr.d[k / 32] as f64;
                            let p = wf[r * cols + k] * xr.q[k] as f64 * d;
                            want += p;
                            mag += p.abs();
                            bound += wf[r * cols + k].abs() * d / 2.0;
                        }
                        let err = (out[r] as f64 - want).abs();
                        assert!(
                            err <= 1e-5 * mag,
                            "{level:?} {kind:?} {rows}x{cols} row {r}: {} want {want} (err {err:e}, mag {mag})",
                            out[r]
                        );
                        let off = (out[r] as f64 - exact[r] as f64).abs();
                        assert!(
                            off <= bound + 1e-5 * mag,
                            "{level:?} {kind:?} row {r}: {off:e} from exact, bound {bound:e}"
                        );
                        differs |= out[r] != exact[r];
                    }
                    assert!(
                        differs,
                        "{level:?} {kind:?} {rows}x{cols}: equal to the exact kernels"
                    );
                    assert_eq!(out[rows..], out0[rows..], "wrote past the output");
                }
            }
        }
    }
}

/// With [`Numerics::Int16`], a call of 2 to 16 tokens (one chunk of 8 and a rest, or two) gives
/// each token exactly (bit for bit) what its own one-token call gives, with bias and
/// accumulation, so a row's result does not depend on the batch it is computed in; 17 tokens
/// run the exact kernels.
#[test]
fn int16_tokens_round_like_one_token_calls() {
    if simd::detected() < Level::Avx2 {
        println!("SKIPPED: this CPU has no AVX2, so Numerics::Int16 runs the exact kernels");
        return;
    }
    let level = simd::detected();
    for kind in INT16_KINDS {
        let n = kind.block_elems();
        let (rows, cols) = (13, if n == 32 { 6 * n } else { 2 * n });
        let w = quant_matrix(kind, rows, cols, true, 99);
        let ldx = cols + 5;
        for tokens in 2..=17 {
            let x = rand_vec((tokens - 1) * ldx + cols, 5 + tokens as u64);
            let out0 = rand_vec(tokens * rows, 6);
            let mut out = out0.clone();
            matmul_with(
                level,
                Numerics::Int16,
                &w,
                &x,
                ldx,
                tokens,
                &mut out,
                rows,
                true,
            );
            let mut exact = out0.clone();
            matmul_at(level, &w, &x, ldx, tokens, &mut exact, rows, true);
            for t in 0..tokens {
                let mut one = out0[t * rows..(t + 1) * rows].to_vec();
                let xt = &x[t * ldx..t * ldx + cols];
                matmul_with(
                    level,
                    Numerics::Int16,
                    &w,
                    xt,
                    cols,
                    1,
                    &mut one,
                    rows,
                    true,
                );
                let got = &out[t * rows..(t + 1) * rows];
                if tokens <= 16 {
                    assert_eq!(got, &one[..], "{kind:?} token {t} of {tokens}");
                } else {
                    assert_eq!(
                        got,
                        &exact[t * rows..(t + 1) * rows],
                        "{kind:?} 17 tokens run exact"
                    );
                }
            }
        }
    }
}

/// A matrix of parts in different formats (`WeightData::Parts`, a merged qkv whose v is stored
/// differently) gives, bit for bit, what each part gives alone into its share of the output,
/// for every token count, both numerics, bias and accumulation; it matches the f64 reference;
/// its rows read back as each part's; a wrong total of rows is refused.
#[test]
fn parts_multiply_as_each_part_alone() {
    let cols = 512;
    let specs: [(Option<QuantKind>, usize); 4] = [
        (Some(QuantKind::Q5_0), 40),
        (Some(QuantKind::Q8_0), 24),
        (None, 9),
        (Some(QuantKind::Q4_K), 19),
    ];
    let alone: Vec<PackedMatrix> = specs
        .iter()
        .enumerate()
        .map(|(i, &(kind, rows))| match kind {
            Some(k) => quant_matrix(k, rows, cols, true, 50 + i as u64),
            None => PackedMatrix {
                rows,
                cols,
                data: WeightData::F32(rand_vec(rows * cols, 60).into()),
                bias: Some(rand_vec(rows, 61)),
            },
        })
        .collect();
    let rows: usize = alone.iter().map(|m| m.rows).sum();
    let take = |m: &PackedMatrix| match &m.data {
        WeightData::F32(v) => WeightData::F32(v.clone()),
        WeightData::Quant { kind, blocks } => WeightData::Quant {
            kind: *kind,
            blocks: blocks.clone(),
        },
        _ => unreachable!("the parts built above"),
    };
    let w = PackedMatrix {
        rows,
        cols,
        data: WeightData::Parts(
            alone
                .iter()
                .map(|m| MatrixPart {
                    rows: m.rows,
                    data: take(m),
                })
                .collect(),
        ),
        bias: Some(alone.iter().flat_map(|m| m.bias.clone().unwrap()).collect()),
    };
    assert!(w.data.check_shape(rows, cols).is_ok());
    assert!(w.data.check_shape(rows + 1, cols).is_err());
    assert_eq!(w.bytes(), alone.iter().map(|m| m.bytes()).sum::<usize>());
    let level = simd::detected();
    for numerics in Numerics::ALL {
        for tokens in [1, 2, 5, 16, 17, 40] {
            let ldx = cols + 3;
            let x = rand_vec((tokens - 1) * ldx + cols, 70 + tokens as u64);
            let out0 = rand_vec(tokens * rows, 71);
            let mut got = out0.clone();
            matmul_with(level, numerics, &w, &x, ldx, tokens, &mut got, rows, true);
            let mut start = 0;
            for m in &alone {
                let mut want = vec![0f32; tokens * m.rows];
                for t in 0..tokens {
                    want[t * m.rows..(t + 1) * m.rows]
                        .copy_from_slice(&out0[t * rows + start..t * rows + start + m.rows]);
                }
                matmul_with(level, numerics, m, &x, ldx, tokens, &mut want, m.rows, true);
                for t in 0..tokens {
                    assert_eq!(
                        &got[t * rows + start..t * rows + start + m.rows],
                        &want[t * m.rows..(t + 1) * m.rows],
                        "{numerics:?} {tokens} tokens, part at row {start}"
                    );
                }
                start += m.rows;
            }
        }
    }
    for tokens in [1, 3, 17] {
        run_and_compare(level, &w, tokens, true, true, 80).unwrap();
    }
    let mut row = vec![0f32; cols];
    let mut one = vec![0f32; cols];
    let mut start = 0;
    for m in &alone {
        for n in [0, m.rows - 1] {
            w.data.row_f32(start + n, cols, &mut row);
            m.data.row_f32(n, cols, &mut one);
            assert_eq!(row, one);
        }
        start += m.rows;
    }
}

/// `Numerics::Bf16` on an AVX512-BF16 CPU: calls of more than 16 tokens on bf16 or quantized
/// weights equal the f64 product of the weights (quantized ones dequantized, then rounded to
/// bf16) with the activations rounded to bf16, within the f32 rounding of the sum (a bound
/// tighter than what leaving the activations unrounded moves the result, which the test
/// checks); a token's results do not depend on the other tokens of the call; odd k, partial
/// panels, bias, accumulation and mixed-format matrices are handled; everything else (up to 16
/// tokens, f32 weights) is the exact path bit for bit.
#[test]
fn bf16_activations_match_rounded_reference() {
    if !simd::available_levels().contains(&Level::Avx512Bf16) {
        println!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    // With AMX on (an AMX-BF16 CPU, `KILN_AMX` not `0`), every case whose k is a multiple of 32
    // runs the AMX tiles, the others the `vdpbf16ps` panels; `bf16_panels_without_amx` reruns
    // this test with AMX off.
    #[cfg(target_arch = "x86_64")]
    println!(
        "AMX tiles: {}",
        if super::amx::enabled() { "on" } else { "off" }
    );
    let rounded = |w: &PackedMatrix| -> Vec<f64> {
        weights_f64(w)
            .into_iter()
            .map(|v| bf16::from_f64(v).to_f64())
            .collect()
    };
    for (rows, cols) in [(70, 320), (33, 77), (64, 1536), (260, 1536)] {
        let w = PackedMatrix {
            rows,
            cols,
            data: WeightData::BF16(
                rand_vec(rows * cols, cols as u64)
                    .iter()
                    .map(|&v| bf16::from_f32(v))
                    .collect(),
            ),
            bias: Some(rand_vec(rows, 5)),
        };
        check_bf16_rounded(&w, &weights_f64(&w));
        // Up to 16 tokens, and f32 weights: the exact path.
        let f = PackedMatrix {
            rows,
            cols,
            data: WeightData::F32(rand_vec(rows * cols, 9).into()),
            bias: None,
        };
        for (i, (m, tokens)) in [(&w, 16), (&w, 1), (&f, 24)].into_iter().enumerate() {
            check_bf16_is_exact(m, tokens, &format!("{rows}x{cols} case {i}"));
        }
    }
    // Quantized weights: the dequantized values rounded to bf16.
    for (kind, rows, cols) in [
        (QuantKind::Q4_1, 70, 320),
        (QuantKind::Q8_0, 33, 96),
        (QuantKind::Q5_0, 64, 1536),
        (QuantKind::Q4_K, 40, 512),
        (QuantKind::Q6_K, 35, 256),
    ] {
        let q = quant_matrix(kind, rows, cols, true, 7);
        check_bf16_rounded(&q, &rounded(&q));
        check_bf16_is_exact(&q, 16, kind.name());
    }
    // A merged linear of Q5_0 and Q8_0 parts (Qwen2.5-Coder's qkv) and one with an f32 part.
    let parts = |second: PackedMatrix| {
        let first = quant_matrix(QuantKind::Q5_0, 40, 128, false, 3);
        let rows = first.rows + second.rows;
        PackedMatrix {
            rows,
            cols: 128,
            data: WeightData::Parts(vec![
                MatrixPart {
                    rows: first.rows,
                    data: first.data,
                },
                MatrixPart {
                    rows: second.rows,
                    data: second.data,
                },
            ]),
            bias: Some(rand_vec(rows, 11)),
        }
    };
    let mixed = parts(quant_matrix(QuantKind::Q8_0, 8, 128, false, 4));
    check_bf16_rounded(&mixed, &rounded(&mixed));
    let with_f32 = parts(PackedMatrix {
        rows: 8,
        cols: 128,
        data: WeightData::F32(rand_vec(8 * 128, 12).into()),
        bias: None,
    });
    // Its f32 part runs exactly (activations unrounded), its Q5_0 part rounded.
    let tokens = 20;
    let x = rand_vec(tokens * 128, 13);
    let mut a = vec![0f32; tokens * 48];
    let mut b = vec![0f32; tokens * 48];
    for (numerics, out) in [(Numerics::Bf16, &mut a), (Numerics::Exact, &mut b)] {
        matmul_with(
            Level::Avx512Bf16,
            numerics,
            &with_f32,
            &x,
            128,
            tokens,
            out,
            48,
            false,
        );
    }
    let same = |n: usize| (0..tokens).all(|t| a[t * 48 + n].to_bits() == b[t * 48 + n].to_bits());
    assert!((40..48).all(same), "the f32 part was rounded");
    assert!(!(0..40).all(same), "the Q5_0 part was not rounded");
}

/// `Numerics::Bf16` calls of 17, 24 and 40 tokens on `w` against `wf` (the weights as the
/// mode rounds them) times the activations rounded to bf16 (see
/// [`bf16_activations_match_rounded_reference`]).
fn check_bf16_rounded(w: &PackedMatrix, wf: &[f64]) {
    let (rows, cols) = (w.rows, w.cols);
    let level = Level::Avx512Bf16;
    let bias = w.bias.as_ref().unwrap();
    for tokens in [17, 24, 40] {
        let x = rand_vec(tokens * cols, 40 + tokens as u64);
        let start = rand_vec(tokens * rows, 41);
        let mut got = start.clone();
        matmul_with(
            level,
            Numerics::Bf16,
            w,
            &x,
            cols,
            tokens,
            &mut got,
            rows,
            true,
        );
        let mut moved = 0.0f64;
        for t in 0..tokens {
            for n in 0..rows {
                let (mut sum, mut abs, mut unrounded) = (0.0f64, 0.0f64, 0.0f64);
                for c in 0..cols {
                    let xv = x[t * cols + c];
                    let p = wf[n * cols + c] * bf16::from_f32(xv).to_f64();
                    sum += p;
                    abs += p.abs();
                    unrounded += wf[n * cols + c] * xv as f64;
                }
                let want = start[t * rows + n] as f64 + sum + bias[n] as f64;
                // The sum's rounding (k terms; at most 16·√k of them for these seeds, far
                // inside the worst case), then the bias and accumulation roundings.
                let terms = (cols as f64).min(16.0 * (cols as f64).sqrt());
                let ends = start[t * rows + n].abs() as f64 + sum.abs() + bias[n].abs() as f64;
                let tol = f32::EPSILON as f64 * (terms * abs + 4.0 * ends);
                let g = got[t * rows + n] as f64;
                assert!(
                    (g - want).abs() <= tol,
                    "{rows}x{cols}, {tokens} tokens, t={t} n={n}: {g} vs {want} (tol {tol})"
                );
                moved = moved.max((sum - unrounded).abs() / tol);
            }
        }
        assert!(
            moved > 1.0,
            "{rows}x{cols} {tokens}: the test cannot tell rounded activations from exact ones ({moved})"
        );
        // The first 17 tokens alone: the same bits.
        let mut alone = start[..17 * rows].to_vec();
        matmul_with(
            level,
            Numerics::Bf16,
            w,
            &x,
            cols,
            17,
            &mut alone,
            rows,
            true,
        );
        assert!(
            same_bits(&alone, &got[..17 * rows]),
            "{rows}x{cols}: a token's results depend on the call"
        );
    }
}

/// Where AMX runs `Numerics::Bf16`'s products, [`bf16_activations_match_rounded_reference`]
/// again in a child process of this test binary with `KILN_AMX=0` (read once per process), so
/// the `vdpbf16ps` panels stay tested on AMX CPUs too.
#[cfg(target_arch = "x86_64")]
#[test]
fn bf16_panels_without_amx() {
    if !super::amx::enabled() {
        println!("skipped: AMX is off here, so the panels ran in the test itself");
        return;
    }
    let name = "backend::cpu::matmul::tests::bf16_activations_match_rounded_reference";
    let out = std::process::Command::new(std::env::current_exe().expect("test binary path"))
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env("KILN_AMX", "0")
        .output()
        .expect("run the test binary again");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("AMX tiles: off") && text.contains("1 passed"),
        "the panels without AMX:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `n` f32 with every significand bit random, random signs and exponents over 2⁻³⁰..2¹⁰: the
/// low bits the AMX three-part split must keep.
fn full_bits(n: usize, seed: u64) -> Vec<f32> {
    xorshift(seed)
        .take(n)
        .map(|s| {
            let (sign, exp, mant) = ((s >> 63) as u32, 97 + (s >> 32) as u32 % 40, s as u32);
            f32::from_bits(sign << 31 | exp << 23 | (mant & 0x007f_ffff))
        })
        .collect()
}

/// Exact products of bf16 weights on AMX-BF16 tiles (calls of more than 16 tokens at the
/// AVX512-BF16 level, activations cut into three bf16 parts): every product is exact, so
/// one-hot weights give back each activation bit for bit; random weights against activations
/// with all 24 significant bits match the f64 reference within 10⁻⁶ of `Σ|terms|` (dropping the
/// low parts would miss by about 8·10⁻⁶: truncation is biased), with partial panels and
/// tail steps, bias and accumulation; an infinity or NaN gives what the f32 kernels give; a
/// token's results do not depend on the call's other tokens.
#[cfg(target_arch = "x86_64")]
#[test]
fn exact_amx_products_are_exact() {
    if !super::amx::enabled() {
        println!("SKIPPED: no AMX-BF16 tiles in this process (the CPU, Linux or KILN_AMX=0)");
        return;
    }
    let level = Level::Avx512Bf16;
    let bf16_matrix =
        |rows: usize, cols: usize, v: &dyn Fn(usize) -> f32, bias: bool| PackedMatrix {
            rows,
            cols,
            data: WeightData::BF16((0..rows * cols).map(|i| bf16::from_f32(v(i))).collect()),
            bias: bias.then(|| rand_vec(rows, 7)),
        };
    // One-hot weights: output n of each token is its activation n % cols.
    let (rows, cols, tokens) = (96, 64, 40);
    let one_hot = bf16_matrix(
        rows,
        cols,
        &|i| f32::from(i % cols == (i / cols) % cols),
        false,
    );
    let x = full_bits(tokens * cols, 11);
    let mut out = vec![0f32; tokens * rows];
    matmul_at(level, &one_hot, &x, cols, tokens, &mut out, rows, false);
    for t in 0..tokens {
        for n in 0..rows {
            let (got, want) = (out[t * rows + n], x[t * cols + n % cols]);
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "token {t}, output {n}: {got} for {want}"
            );
        }
    }
    // Random weights, the f64 reference, within 1e-6 of the terms' magnitude.
    for (rows, cols) in [(70, 64), (70, 320), (33, 1536), (300, 1536)] {
        let wv = rand_vec(rows * cols, 12);
        for tokens in [17, 31, 32, 33, 70] {
            let acc = tokens % 2 == 1;
            let w = bf16_matrix(rows, cols, &|i| wv[i], acc);
            let ldx = cols + 3;
            let x = full_bits((tokens - 1) * ldx + cols, 13 + tokens as u64);
            let out0 = rand_vec(tokens * rows, 14);
            let mut out = out0.clone();
            matmul_at(level, &w, &x, ldx, tokens, &mut out, rows, acc);
            if let Err(e) = compare_within(&w, &x, ldx, tokens, &out0, &out, rows, acc, 1e-6) {
                panic!("{rows}x{cols}, {tokens} tokens: {e}");
            }
            // The last 17 tokens alone: the same bits.
            let alone_from = tokens - 17;
            let mut alone = out0[alone_from * rows..].to_vec();
            matmul_at(
                level,
                &w,
                &x[alone_from * ldx..],
                ldx,
                17,
                &mut alone,
                rows,
                acc,
            );
            assert!(
                same_bits(&alone, &out[alone_from * rows..]),
                "{rows}x{cols}, {tokens} tokens: the last 17 alone differ"
            );
        }
    }
    // Non-finite activations against all-one weights: a sum with +∞ is +∞, with +∞ and −∞ or a
    // NaN it is NaN (the scalar kernel gives the same), and the other tokens keep their values.
    let (rows, cols, tokens) = (32, 64, 20);
    let ones = bf16_matrix(rows, cols, &|_| 1.0, false);
    let mut x = full_bits(tokens * cols, 15);
    x[3 * cols + 5] = f32::INFINITY;
    x[4 * cols + 1] = f32::INFINITY;
    x[4 * cols + 9] = f32::NEG_INFINITY;
    x[5 * cols + 7] = f32::NAN;
    x[6 * cols + 2] = f32::NEG_INFINITY;
    let mut amx = vec![0f32; tokens * rows];
    let mut scalar = vec![0f32; tokens * rows];
    matmul_at(level, &ones, &x, cols, tokens, &mut amx, rows, false);
    matmul_at(
        Level::Scalar,
        &ones,
        &x,
        cols,
        tokens,
        &mut scalar,
        rows,
        false,
    );
    for t in 0..tokens {
        for n in 0..rows {
            let (a, r) = (amx[t * rows + n], scalar[t * rows + n]);
            let want = match t {
                3 => Some(f32::INFINITY),
                6 => Some(f32::NEG_INFINITY),
                4 | 5 => None,
                _ => Some(r),
            };
            match want {
                Some(v) if v.is_infinite() => assert_eq!(a, v, "token {t}"),
                Some(v) => assert!(
                    (a - v).abs() <= 1e-5 * v.abs().max(1.0),
                    "token {t}: {a} {v}"
                ),
                None => assert!(a.is_nan() && r.is_nan(), "token {t}: {a} (scalar {r})"),
            }
        }
    }
}

/// A `Numerics::Bf16` call of `tokens` tokens on `m` gives the exact path's bits.
fn check_bf16_is_exact(m: &PackedMatrix, tokens: usize, what: &str) {
    let level = Level::Avx512Bf16;
    let x = rand_vec(tokens * m.cols, 50);
    let mut a = vec![0f32; tokens * m.rows];
    let mut b = vec![0f32; tokens * m.rows];
    for (numerics, out) in [(Numerics::Bf16, &mut a), (Numerics::Exact, &mut b)] {
        matmul_with(level, numerics, m, &x, m.cols, tokens, out, m.rows, false);
    }
    assert!(
        same_bits(&a, &b),
        "{what}, {tokens} tokens: not the exact path"
    );
}

/// `avx512::group_words` gives word `i` the `d` (first little-endian 16 bits) of block `i` and
/// word `16 + i` its `m` (the next 16; zero for the formats without a min) for every legacy
/// format and every group size, zeros past the group, reading only the group's bytes (the
/// buffer ends with the group).
#[cfg(target_arch = "x86_64")]
#[test]
fn group_words_gather_each_blocks_scales() {
    if simd::detected() < Level::Avx512 {
        println!("SKIPPED: this CPU has no AVX-512");
        return;
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    unsafe fn words<Q: x86::Legacy>(p: &[u8], n: usize) -> [u16; 32] {
        std::mem::transmute(avx512::group_words::<Q>(p.as_ptr(), n))
    }
    fn check<Q: x86::Legacy>() {
        for n in 1..=16 {
            let bytes: Vec<u8> = (0..n * Q::BYTES)
                .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8)
                .collect();
            // SAFETY: the CPU has AVX-512 (checked above); `bytes` holds `n` blocks.
            let got = unsafe { words::<Q>(&bytes, n) };
            for (l, &g) in got.iter().enumerate() {
                let (block, word) = (l % 16, l / 16);
                let want = if block < n && (word == 0 || Q::HAS_MIN) {
                    let b = &bytes[block * Q::BYTES + 2 * word..];
                    u16::from_le_bytes([b[0], b[1]])
                } else {
                    0
                };
                assert_eq!(g, want, "{} bytes per block, n {n}, word {l}", Q::BYTES);
            }
        }
    }
    check::<quant::Q4_0>();
    check::<quant::Q4_1>();
    check::<quant::Q5_0>();
    check::<quant::Q5_1>();
    check::<quant::Q8_0>();
}

/// The formats [`Numerics::Int8`] interleaves.
const INT8_KINDS: [QuantKind; 5] = [
    QuantKind::Q8_0,
    QuantKind::Q4_0,
    QuantKind::Q4_1,
    QuantKind::Q5_0,
    QuantKind::Q5_1,
];

/// 8-bit rounding of activations: the vectorised kernel equals the scalar reference bit for bit
/// (random blocks, a zero block, subnormal and huge magnitudes, exact ties, NaN and infinities),
/// and the reference rounds as documented.
#[test]
fn int8_rounding_matches_reference() {
    let mut x = rand_vec(32 * 12, 8);
    x[32..64].fill(0.0);
    for (i, v) in x[64..96].iter_mut().enumerate() {
        *v = (i as f32 - 16.0) * 1e-40;
    }
    for v in &mut x[96..128] {
        *v *= 3e38;
    }
    x[128] = 127.0;
    for (i, v) in x[129..160].iter_mut().enumerate() {
        *v = i as f32 - 15.5;
    }
    x[170] = f32::NAN;
    x[200] = f32::INFINITY;
    x[240] = f32::NEG_INFINITY;
    let r = int8::quantize_ref(&x);
    assert_eq!(r.d[1], 0.0);
    assert!(r.d[5].is_nan() && r.d[6].is_nan() && r.d[7].is_nan());
    assert_eq!(&r.q[129..133], &[-16, -14, -14, -12], "ties round to even");
    for (b, c) in x.chunks_exact(32).enumerate() {
        if r.d[b].is_finite() {
            let qs: i32 = r.q[b * 32..(b + 1) * 32].iter().map(|&q| q as i32).sum();
            assert_eq!(qs, r.qsums[b], "block {b}");
            for (q, v) in r.q[b * 32..(b + 1) * 32].iter().zip(c) {
                let err = (*q as f32 * r.d[b] - v).abs();
                assert!(
                    err <= r.d[b] * 0.5001 + f32::MIN_POSITIVE,
                    "block {b}: {v} as {q}"
                );
            }
        }
    }
    let bits = |d: &[f32]| d.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let mut vectors: Vec<(&str, int8::XI8)> = Vec::new();
    if avx512_i8::available() {
        // SAFETY: the CPU has AVX-512 F/BW/VL; `x` is whole blocks.
        vectors.push(("avx512", unsafe { avx512_i8::quantize(&x) }));
    } else {
        println!("SKIPPED (AVX-512 rounding): this CPU has no AVX512-VNNI");
    }
    if avx2_i8::available() {
        // SAFETY: the CPU has AVX2; `x` is whole blocks.
        vectors.push(("avx2", unsafe { avx2_i8::quantize(&x) }));
    } else {
        println!("SKIPPED (AVX2 rounding): this CPU has no AVX2");
    }
    for (name, v) in vectors {
        assert_eq!(v.q, r.q, "{name}");
        assert_eq!(v.qsums, r.qsums, "{name}");
        assert_eq!(bits(&v.d), bits(&r.d), "{name}");
        assert_eq!(bits(&v.sums), bits(&r.sums), "{name}");
    }
}

/// Interleaving keeps every weight: each row dequantizes exactly as its ggml blocks do, the
/// shape is checked, and a matrix regrouped whole or in parts keeps its bytes (plus padding).
#[test]
fn int8_interleaving_keeps_every_row() {
    for kind in INT8_KINDS {
        for rows in [1, 15, 16, 17, 40] {
            let cols = 96;
            let w = quant_matrix(kind, rows, cols, false, rows as u64);
            let want = weights_f64(&w);
            let data = w.data.interleaved(rows, cols);
            assert!(matches!(data, WeightData::Interleaved(_)), "{kind:?}");
            data.check_shape(rows, cols).unwrap();
            assert!(data.check_shape(rows + 16, cols).is_err());
            assert_eq!(data_f64(&data, rows, cols), want, "{kind:?} {rows} rows");
            let padded = rows.div_ceil(16) * 16 * cols / 32 * kind.block_bytes();
            assert_eq!(data.bytes(), padded, "{kind:?} {rows} rows");
        }
    }
    let other = quant_matrix(QuantKind::Q6_K, 4, 256, false, 1);
    assert!(matches!(
        other.data.interleaved(4, 256),
        WeightData::Quant { .. }
    ));
    // A merged linear of two formats (Qwen2.5-Coder's qkv): the Q8_0 part is regrouped, the
    // Q6_K part stays, and a call computes each part its way.
    let (q8, q6) = (
        quant_matrix(QuantKind::Q8_0, 20, 256, false, 2),
        quant_matrix(QuantKind::Q6_K, 7, 256, false, 3),
    );
    let parts = PackedMatrix {
        rows: 27,
        cols: 256,
        data: WeightData::Parts(vec![
            MatrixPart {
                rows: 20,
                data: q8.data,
            },
            MatrixPart {
                rows: 7,
                data: q6.data,
            },
        ]),
        bias: None,
    };
    let mut exact = vec![0f32; 2 * 27];
    let x = rand_vec(2 * 256, 4);
    matmul_with(
        simd::level(),
        Numerics::Exact,
        &parts,
        &x,
        256,
        2,
        &mut exact,
        27,
        false,
    );
    let regrouped = PackedMatrix {
        data: parts.data.interleaved(27, 256),
        ..parts
    };
    let WeightData::Parts(p) = &regrouped.data else {
        panic!("parts stay parts")
    };
    assert!(matches!(p[0].data, WeightData::Interleaved(_)));
    assert!(matches!(p[1].data, WeightData::Quant { .. }));
    let mut got = vec![0f32; 2 * 27];
    matmul_with(
        simd::level(),
        Numerics::Int8,
        &regrouped,
        &x,
        256,
        2,
        &mut got,
        27,
        false,
    );
    let wf = weights_f64(&regrouped);
    for t in 0..2 {
        let x8 = int8::quantize_ref(&x[t * 256..(t + 1) * 256]);
        for r in 0..27 {
            let (g, e) = (got[t * 27 + r], exact[t * 27 + r]);
            if r < 20 {
                // 8-bit activations: within the rounding's bound Σ|w|·d/2 of exact.
                let bound: f64 = (0..256)
                    .map(|k| wf[r * 256 + k].abs() * x8.d[k / 32] as f64 / 2.0)
                    .sum();
                let off = (g as f64 - e as f64).abs();
                assert!(
                    off <= bound * 1.001,
                    "token {t} row {r}: {g} vs {e}, bound {bound}"
                );
                assert_ne!(g, e, "token {t} row {r}: the Q8_0 part ran exact");
            } else {
                assert_eq!(g, e, "token {t} row {r}: the Q6_K part runs exact");
            }
        }
    }
}

/// Interleaved weights times 8-bit activations on the AMX-INT8 tiles (calls of 16 tokens or
/// more): the same bits as the scalar reference (and so as the VNNI kernel), with row ranges
/// that cut groups, bias, accumulation, block counts that leave one to three blocks after the
/// passes of four, and token counts that leave partial tiles.
#[cfg(target_arch = "x86_64")]
#[test]
fn amx_int8_tiles_match_the_reference() {
    if !super::amx_i8::enabled() {
        println!("SKIPPED: no AMX-INT8 tiles in this process (the CPU, Linux or KILN_AMX=0)");
        return;
    }
    for kind in INT8_KINDS {
        for (rows, cols, tokens) in [
            (16, 32, 16),
            (37, 96, 17),
            (40, 160, 33),
            (70, 288, 20),
            (33, 512, 48),
        ] {
            let seed = (rows * 100 + cols + tokens) as u64;
            let mut w = quant_matrix(kind, rows, cols, true, seed);
            w.data = w.data.interleaved(rows, cols);
            let WeightData::Interleaved(m) = &w.data else {
                unreachable!()
            };
            let ldx = cols + 3;
            let x = rand_vec((tokens - 1) * ldx + cols, seed + 2);
            let out0 = rand_vec(tokens * rows, seed + 3);
            let x8: Vec<int8::XI8> = (0..tokens)
                .map(|t| int8::quantize_ref(&x[t * ldx..t * ldx + cols]))
                .collect();
            let tiles = super::amx_i8::Tokens::new(&x8, cols);
            for acc in [false, true] {
                let run = |x8t, kernel: &dyn Fn(&Job)| {
                    int8_job_outputs(&w, &x, ldx, tokens, &x8, x8t, &out0, acc, kernel)
                };
                let reference = run(None, &|job| unsafe { int8::rows_ref(m, &x8, job) });
                let amx = run(Some(&tiles), &|job| unsafe {
                    super::amx_i8::rows(m, &tiles, job)
                });
                assert!(
                    same_bits(&amx, &reference),
                    "{kind:?} {rows}x{cols} x{tokens}, accumulate {acc}"
                );
            }
        }
    }
}

/// `out0` with every output of `w` written by `kernel`, called once per row range that cuts
/// groups (at 5 and 21: groups entered and left in the middle), with the jobs the integer
/// kernels' tests share.
#[allow(clippy::too_many_arguments)]
fn int8_job_outputs(
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    x8: &[int8::XI8],
    x8t: Option<&super::amx_i8::Tokens>,
    out0: &[f32],
    accumulate: bool,
    kernel: &dyn Fn(&Job),
) -> Vec<f32> {
    let rows = w.rows;
    let mut out = out0.to_vec();
    for rg in [
        0..rows.min(5),
        rows.min(5)..rows.min(21),
        rows.min(21)..rows,
    ] {
        let job = Job {
            x8: Some(x8),
            x8t,
            ..bare_job(w, x, ldx, tokens, rg, &mut out, rows, accumulate)
        };
        kernel(&job);
    }
    out
}

/// Interleaved weights times 8-bit activations: the AVX512-VNNI kernel equals the scalar
/// reference bit for bit (row ranges that cut groups, bias, accumulation, 1 to 20 tokens:
/// chunks of 8 and rests), the reference equals the f64 product of the dequantized weights with
/// the rounded activations `d·q` within f32 rounding of the sums and stays within the rounding's
/// bound `Σ|w|·d/2` of the exact product, and a token's outputs are the same bits in every
/// call it is part of.
#[test]
fn int8_kernels_match_the_reference() {
    let vnni = avx512_i8::available();
    if !vnni {
        println!("SKIPPED (AVX-512 kernel): this CPU has no AVX512-VNNI; the reference is checked");
    }
    let avx2 = avx2_i8::available();
    if !avx2 {
        println!("SKIPPED (AVX2 kernel): this CPU has no AVX2; the reference is checked");
    }
    for kind in INT8_KINDS {
        for (rows, cols, tokens) in [
            (1, 32, 1),
            (16, 64, 3),
            (37, 96, 1),
            (40, 160, 9),
            (70, 64, 20),
        ] {
            let seed = (rows * 100 + cols + tokens) as u64;
            let mut w = quant_matrix(kind, rows, cols, true, seed);
            let exact_w = quant_matrix(kind, rows, cols, true, seed);
            w.data = w.data.interleaved(rows, cols);
            let ldx = cols + 3;
            let x = rand_vec((tokens - 1) * ldx + cols, seed + 2);
            let out0 = rand_vec(tokens * rows, seed + 3);
            let WeightData::Interleaved(m) = &w.data else {
                unreachable!()
            };
            let x8: Vec<int8::XI8> = (0..tokens)
                .map(|t| int8::quantize_ref(&x[t * ldx..t * ldx + cols]))
                .collect();
            for acc in [false, true] {
                let run = |kernel: &dyn Fn(&Job)| {
                    int8_job_outputs(&w, &x, ldx, tokens, &x8, None, &out0, acc, kernel)
                };
                let reference = run(&|job| unsafe { int8::rows_ref(m, &x8, job) });
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                if vnni {
                    let vector = run(&|job| unsafe { avx512_i8::rows(m, &x8, job) });
                    assert_eq!(
                        bits(&vector),
                        bits(&reference),
                        "avx512 {kind:?} {rows}x{cols} x{tokens}"
                    );
                }
                if avx2 {
                    let vector = run(&|job| unsafe { avx2_i8::rows(m, &x8, job) });
                    assert_eq!(
                        bits(&vector),
                        bits(&reference),
                        "avx2 {kind:?} {rows}x{cols} x{tokens}"
                    );
                }
                let mut exact = out0.clone();
                matmul_at(
                    Level::Scalar,
                    &exact_w,
                    &x,
                    ldx,
                    tokens,
                    &mut exact,
                    rows,
                    acc,
                );
                let wf = weights_f64(&exact_w);
                for (t, xt) in x8.iter().enumerate() {
                    for r in 0..rows {
                        let o = t * rows + r;
                        let base = if acc { out0[o] as f64 } else { 0.0 }
                            + w.bias.as_ref().map_or(0.0, |b| b[r] as f64);
                        let (mut want, mut mag, mut bound) = (base, base.abs(), 0.0);
                        for k in 0..cols {
                            let d = xt.d[k / 32] as f64;
                            let p = wf[r * cols + k] * xt.q[k] as f64 * d;
                            want += p;
                            mag += p.abs();
                            bound += wf[r * cols + k].abs() * d / 2.0;
                        }
                        let err = (reference[o] as f64 - want).abs();
                        assert!(
                            err <= 1e-5 * mag,
                            "{kind:?} {rows}x{cols} token {t} row {r}: {} want {want} (err {err:e})",
                            reference[o]
                        );
                        let off = (reference[o] as f64 - exact[o] as f64).abs();
                        assert!(
                            off <= bound + 1e-5 * mag,
                            "{kind:?} token {t} row {r}: {off:e} from exact, bound {bound:e}"
                        );
                    }
                }
                // Through the entry point, each token alone gives the same bits.
                let mut all = out0.clone();
                matmul_with(
                    simd::level(),
                    Numerics::Int8,
                    &w,
                    &x,
                    ldx,
                    tokens,
                    &mut all,
                    rows,
                    acc,
                );
                assert_eq!(
                    all, reference,
                    "{kind:?} {rows}x{cols} x{tokens}: entry point"
                );
                for t in 0..tokens {
                    let mut one = out0[t * rows..(t + 1) * rows].to_vec();
                    let xt = &x[t * ldx..t * ldx + cols];
                    matmul_with(
                        simd::level(),
                        Numerics::Int8,
                        &w,
                        xt,
                        cols,
                        1,
                        &mut one,
                        rows,
                        acc,
                    );
                    assert_eq!(
                        one,
                        &all[t * rows..(t + 1) * rows],
                        "{kind:?} token {t} alone"
                    );
                }
            }
        }
    }
}

/// The AVX2 integer kernel's 16-bit sums at their bounds: every quant at its largest magnitude
/// (Q4 nibbles 15, Q5 quants 31 with every fifth bit set, Q8_0 −128 and 127) and at zero,
/// against activations of ±127 (every element positive, negative, or alternating), equal to
/// the scalar reference bit for bit in calls of few and of many tokens: a saturated or wrapped
/// 16-bit sum would differ.
#[test]
fn int8_avx2_sums_at_their_bounds() {
    if !avx2_i8::available() {
        println!("SKIPPED: this CPU has no AVX2");
        return;
    }
    // Three activation patterns, repeated: 18 tokens reach the many-token pass too.
    let (rows, cols, tokens) = (24, 96, 18);
    let x: Vec<f32> = (0..tokens * cols)
        .map(|i| match i / cols % 3 {
            0 => 1.0,
            1 => -1.0,
            _ if i % 2 == 0 => 1.0,
            _ => -1.0,
        })
        .collect();
    let x8: Vec<int8::XI8> = x.chunks_exact(cols).map(int8::quantize_ref).collect();
    assert!(x8.iter().all(|t| t.q.iter().all(|&q| q.abs() == 127)));
    for kind in INT8_KINDS {
        for fill in [0x00u8, 0xff, 0x80, 0x7f] {
            let mut blocks = rand_blocks(kind, rows, cols, u64::from(fill));
            for c in blocks.chunks_exact_mut(kind.block_bytes()) {
                let from = if int8::has_fifth_bit(kind) {
                    int8::ggml_fifth_at(kind)
                } else {
                    int8::ggml_quants_at(kind)
                };
                c[from..].fill(fill);
            }
            let mut w = PackedMatrix {
                rows,
                cols,
                data: WeightData::Quant {
                    kind,
                    blocks: blocks.into(),
                },
                bias: None,
            };
            w.data = w.data.interleaved(rows, cols);
            let WeightData::Interleaved(m) = &w.data else {
                unreachable!()
            };
            let out0 = vec![0f32; tokens * rows];
            let run = |kernel: &dyn Fn(&Job)| {
                int8_job_outputs(&w, &x, cols, tokens, &x8, None, &out0, false, kernel)
            };
            let reference = run(&|job| unsafe { int8::rows_ref(m, &x8, job) });
            let vector = run(&|job| unsafe { avx2_i8::rows(m, &x8, job) });
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&vector),
                bits(&reference),
                "{kind:?} quants {fill:#04x}"
            );
        }
    }
}

const GROUPED_KINDS: [QuantKind; 7] = [
    QuantKind::Q4_0,
    QuantKind::Q4_1,
    QuantKind::Q5_0,
    QuantKind::Q5_1,
    QuantKind::Q8_0,
    QuantKind::Q4_K,
    QuantKind::Q6_K,
];

/// Every grouped format in each layout it is grouped in somewhere: the streams layout, and
/// the halves layout of Q4_0, Q4_1, Q4_K and Q5_0 (AVX2 CPUs).
fn grouped_layouts() -> Vec<(QuantKind, Layout)> {
    let mut all: Vec<_> = GROUPED_KINDS.map(|k| (k, Layout::Streams)).to_vec();
    for kind in GROUPED_KINDS {
        if grouped::halves_kind(kind) {
            all.push((kind, Layout::Halves));
        }
    }
    all
}

/// `w`'s blocks regrouped sixteen rows to a group in `layout`.
fn regrouped_in(w: PackedMatrix, layout: Layout) -> PackedMatrix {
    let WeightData::Quant { kind, blocks } = &w.data else {
        panic!("only block formats regroup")
    };
    let g = Grouped::with_layout(
        *kind,
        layout,
        w.rows,
        w.cols,
        blocks,
        &mut WeightArena::new(),
    );
    PackedMatrix {
        data: WeightData::Grouped(g),
        ..w
    }
}

/// `cols` rounded up to whole blocks of `kind` (the super-block formats' 256).
fn whole_blocks(kind: QuantKind, cols: usize) -> usize {
    cols.div_ceil(kind.block_elems()) * kind.block_elems()
}

/// Grouping keeps every weight: each row dequantizes exactly as its ggml blocks do (through
/// the rebuilt blocks, and through the AVX-512 tile dequantization over row ranges that cut
/// groups), the shape is checked, the bytes are the ggml blocks' (plus a last group's
/// padding and the kernels' read slack), and a merged linear of two formats groups only its
/// groupable part.
#[test]
fn grouping_keeps_every_row() {
    let planes = (QuantKind::Q5_0, Layout::Planes);
    for (kind, layout) in grouped_layouts().into_iter().chain([planes]) {
        for rows in [1, 15, 16, 17, 40] {
            let cols = whole_blocks(kind, 96);
            let w = quant_matrix(kind, rows, cols, false, rows as u64);
            let want = weights_f64(&w);
            let data = regrouped_in(w, layout).data;
            let WeightData::Grouped(m) = &data else {
                panic!("{kind:?} not grouped")
            };
            data.check_shape(rows, cols).unwrap();
            assert!(data.check_shape(rows + 16, cols).is_err());
            assert_eq!(data_f64(&data, rows, cols), want, "{kind:?} {rows} rows");
            let padded = rows.div_ceil(16) * 16 * cols / kind.block_elems() * kind.block_bytes();
            // Q4_K's 12 bytes of packed 6-bit scales and mins become 16 bytes.
            let unpacked = rows.div_ceil(16) * 16 * cols / kind.block_elems() * 4;
            let want_bytes = if kind == QuantKind::Q4_K {
                padded + unpacked
            } else if layout == Layout::Halves && kind == QuantKind::Q5_0 {
                // 24 bytes a row and block for ggml's 22.
                padded / 22 * 24
            } else {
                padded
            };
            assert_eq!(
                data.bytes(),
                want_bytes + grouped::READ_SLACK,
                "{kind:?} {layout:?} {rows} rows"
            );
            for level in [Level::Avx512, Level::Avx2] {
                // Each level's tile dequantization reads its own layouts (the planes layout's
                // calls below AVX-512 dequantize row by row, as `data_f64` does above).
                if (level == Level::Avx512 && layout == Layout::Halves)
                    || (level == Level::Avx2 && layout == Layout::Planes)
                {
                    continue;
                }
                if simd::level() < level {
                    println!(
                        "SKIPPED ({} tile dequantization): not on this CPU",
                        level.name()
                    );
                    continue;
                }
                for r in [0..rows, rows / 3..rows, 1.min(rows)..rows.min(18)] {
                    let mut got = vec![f32::NAN; r.len() * cols];
                    unsafe {
                        if level == Level::Avx512 {
                            avx512_grouped::dequantize(m, r.clone(), &mut got)
                        } else {
                            avx2_grouped::dequantize(m, r.clone(), &mut got)
                        }
                    };
                    let same = got
                        .iter()
                        .zip(&want[r.start * cols..r.end * cols])
                        .all(|(&g, &w)| g as f64 == w && g.to_bits() == (w as f32).to_bits());
                    assert!(
                        same,
                        "{kind:?} {layout:?} rows {r:?}: {} tile dequantization",
                        level.name()
                    );
                }
            }
        }
    }
    let other = quant_matrix(QuantKind::Q5_K, 4, 256, false, 1);
    assert!(matches!(
        other.data.grouped(4, 256),
        WeightData::Quant { .. }
    ));
    let (q5, q6) = (
        quant_matrix(QuantKind::Q5_0, 20, 256, false, 2),
        quant_matrix(QuantKind::Q5_K, 7, 256, false, 3),
    );
    let parts = WeightData::Parts(vec![
        MatrixPart {
            rows: 20,
            data: q5.data,
        },
        MatrixPart {
            rows: 7,
            data: q6.data,
        },
    ])
    .grouped(27, 256);
    let WeightData::Parts(p) = &parts else {
        panic!("parts stay parts")
    };
    assert!(matches!(p[0].data, WeightData::Grouped(_)));
    assert!(matches!(p[1].data, WeightData::Quant { .. }));
}

/// A job over rows `rows` of `w` for `tokens` rows of `x` (`ldx` apart) into `out` (`ldo` apart),
/// with nothing a call prepares: each test sets what its kernel reads.
#[allow(clippy::too_many_arguments)]
fn bare_job<'a>(
    w: &'a PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    rows: Range<usize>,
    out: &mut [f32],
    ldo: usize,
    accumulate: bool,
) -> Job<'a> {
    static NOTHING: std::sync::LazyLock<Prepared> = std::sync::LazyLock::new(Prepared::default);
    Job::new(
        w,
        x,
        ldx,
        tokens,
        rows,
        out.as_mut_ptr(),
        ldo,
        accumulate,
        &NOTHING,
    )
}

/// `0..rows` cut at 5, 11 and 21: groups and half groups entered and left in the middle.
fn row_cuts(rows: usize) -> [Range<usize>; 4] {
    [
        0..rows.min(5),
        rows.min(5)..rows.min(11),
        rows.min(11)..rows.min(21),
        rows.min(21)..rows,
    ]
}

/// Through the entry point in `numerics`, at the CPU's level and at AVX2, a call of `tokens`
/// rows of `x` over `w` (outputs starting as `out0`, accumulated into where `acc`) gives
/// `reference`'s bits, and each token alone the same bits as in the call; `what` names the case.
fn assert_entry_point_bits(
    numerics: Numerics,
    call: (&PackedMatrix, &[f32], usize, usize),
    want: (&[f32], &[f32], bool),
    what: &str,
) {
    assert_entry_point_bits_at(&[simd::level(), Level::Avx2], numerics, call, want, what)
}

/// [`assert_entry_point_bits`] at the given levels only.
fn assert_entry_point_bits_at(
    levels: &[Level],
    numerics: Numerics,
    (w, x, ldx, tokens): (&PackedMatrix, &[f32], usize, usize),
    (out0, reference, acc): (&[f32], &[f32], bool),
    what: &str,
) {
    let (rows, cols) = (w.rows, w.cols);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for &level in levels {
        let mut all = out0.to_vec();
        matmul_with(level, numerics, w, x, ldx, tokens, &mut all, rows, acc);
        assert_eq!(
            bits(&all),
            bits(reference),
            "{what}: {} entry point",
            level.name()
        );
        for t in 0..tokens {
            let mut one = out0[t * rows..(t + 1) * rows].to_vec();
            let xt = &x[t * ldx..t * ldx + cols];
            matmul_with(level, numerics, w, xt, cols, 1, &mut one, rows, acc);
            assert_eq!(
                bits(&one),
                bits(&all[t * rows..(t + 1) * rows]),
                "{what}: token {t} alone, {}",
                level.name()
            );
        }
    }
}

/// Grouped weights: the AVX-512 and AVX2 kernels equal the scalar reference bit for bit (row
/// ranges that cut groups and half groups, bias, accumulation, 1 to 16 tokens: chunks of 8 and
/// rests, the passes of up to four tokens that hold every quarter chain among them, the AVX2
/// passes of one token's two halves or two tokens' one half), the reference equals
/// the f64 product of the dequantized weights within f32 rounding of the sums, and a token's
/// outputs are the same bits in every call of up to 16 tokens it is part of.
#[test]
fn grouped_kernels_match_the_reference() {
    if simd::level() < Level::Avx2 {
        println!("SKIPPED: this CPU has no AVX2 (engines group weights only where it does)");
        return;
    }
    if simd::level() < Level::Avx512 {
        println!("SKIPPED (AVX-512 grouped kernels): not on this CPU");
    }
    for (kind, layout) in grouped_layouts() {
        for (rows, cols, tokens) in [
            (1, 32, 1),
            (16, 64, 3),
            (37, 96, 1),
            (40, 160, 5),
            (70, 64, 8),
            (33, 576, 2),
            (20, 96, 13),
            (24, 64, 4),
            (30, 96, 12),
            (48, 64, 16),
            // Groups longer than the prefetch distance (Qwen2.5's down projection).
            (33, 4864, 1),
        ] {
            let cols = whole_blocks(kind, cols);
            let seed = (rows * 100 + cols + tokens) as u64;
            let w = regrouped_in(quant_matrix(kind, rows, cols, true, seed), layout);
            let WeightData::Grouped(m) = &w.data else {
                unreachable!()
            };
            // The AVX-512 kernels read only the streams layout.
            let avx512 = simd::level() >= Level::Avx512 && layout == Layout::Streams;
            let ldx = cols + 3;
            let x = rand_vec((tokens - 1) * ldx + cols, seed + 2);
            let out0 = rand_vec(tokens * rows, seed + 3);
            for acc in [false, true] {
                let mut reference = out0.clone();
                let mut vector = out0.clone();
                let mut vector2 = out0.clone();
                for rg in row_cuts(rows) {
                    for (out, kernel) in [
                        (&mut reference, Level::Scalar),
                        (&mut vector, Level::Avx512),
                        (&mut vector2, Level::Avx2),
                    ] {
                        if simd::level() < kernel || (kernel == Level::Avx512 && !avx512) {
                            continue;
                        }
                        let job = bare_job(&w, &x, ldx, tokens, rg.clone(), out, rows, acc);
                        unsafe {
                            match kernel {
                                Level::Avx512 => avx512_grouped::rows(m, &job),
                                Level::Avx2 => avx2_grouped::rows(m, &job),
                                _ => grouped::rows_ref(m, &job),
                            }
                        }
                    }
                }
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                if avx512 {
                    assert_eq!(
                        bits(&vector),
                        bits(&reference),
                        "{kind:?} {rows}x{cols} x{tokens}"
                    );
                }
                assert_eq!(
                    bits(&vector2),
                    bits(&reference),
                    "{kind:?} {layout:?} {rows}x{cols} x{tokens}: AVX2"
                );
                if let Err(e) = compare(&w, &x, ldx, tokens, &out0, &reference, rows, acc) {
                    panic!("{kind:?} {layout:?} {rows}x{cols} x{tokens} reference: {e}");
                }
                // Through the entry point at each level, each token alone gives the same bits
                // (tasks of whole groups: one token's go through the AVX2 kernels' pass over
                // both halves, which the cuts above never enter).
                assert_entry_point_bits(
                    Numerics::Exact,
                    (&w, &x, ldx, tokens),
                    (&out0, &reference, acc),
                    &format!("{kind:?} {layout:?} {rows}x{cols} x{tokens}"),
                );
            }
        }
    }
}

/// The AVX2 grouped kernels take 4-bit high nibbles in place against activations divided by
/// 16 (and the halves layout's fields against activations divided by up to 2^10 or 2^12):
/// still the reference's bits where activations are tiny (odd ones whose sixteenth would be
/// subnormal, where the kernels must keep the shift; even ones and exact sixteenths, where they
/// need not), huge or zero, for one token and two; and the halves kernel divides activations
/// down to the least whose 1024th is normal.
#[test]
fn grouped_avx2_kernels_keep_their_bits_on_tiny_and_huge_activations() {
    if simd::level() < Level::Avx2 {
        println!("SKIPPED: this CPU has no AVX2 (engines group weights only where it does)");
        return;
    }
    let smallest_exact = f32::from_bits(5 << 23); // 2^-122: its sixteenth is 2^-126, normal
    let specials = [
        1.0e-39,        // subnormal
        1.5e-37,        // normal, its sixteenth subnormal
        smallest_exact, // the least whose sixteenth is normal
        -smallest_exact * 1.5,
        3.0e37,
        0.0,
        -0.0,
    ];
    for (kind, layout) in grouped_layouts() {
        // The least activation that the halves kernel divides exactly (by 2^10 for Q5_0, by
        // 2^12 for the 4-bit formats): the quotient is 2^-126, normal.
        let bits = if kind == QuantKind::Q5_0 { 10 } else { 12 };
        let least_halved = f32::MIN_POSITIVE * (1u32 << bits) as f32;
        let halves_exact = [least_halved, -least_halved * 1.5, 3.0e37, 0.0, -0.0];
        for (cols, tokens) in [(64, 1), (576, 1), (1536, 1), (576, 2)] {
            let (rows, cols) = (24, whole_blocks(kind, cols));
            let seed = (cols + tokens) as u64;
            // No bias: it would hide the last bits of tiny outputs.
            let w = regrouped_in(quant_matrix(kind, rows, cols, false, seed), layout);
            let WeightData::Grouped(m) = &w.data else {
                unreachable!()
            };
            // Specials at odd places only, at even places only, everywhere; then every
            // activation scaled by 1.37·2^-124 (most of them normal with every mantissa bit
            // used, their sixteenths subnormal, the outputs normal: a sixteenth rounded
            // would show) and by 2^100.
            // Last, for the halves layout: values the kernel divides exactly, everywhere.
            let cases = [
                (Some(1), 1.0, &specials[..]),
                (Some(0), 1.0, &specials[..]),
                (None, 1.0, &specials[..]),
                (Some(2), 1.37 * f32::from_bits(3 << 23), &specials[..]),
                (Some(2), f32::from_bits(227 << 23), &specials[..]),
                (None, 1.0, &halves_exact[..]),
            ];
            for (case, (parity, scale, specials)) in cases.into_iter().enumerate() {
                let mut x = rand_vec(tokens * cols, seed + case as u64);
                for (i, v) in x.iter_mut().enumerate() {
                    *v *= scale;
                    if parity.is_none_or(|p| i % 2 == p) && (i / 2) % 3 == 0 {
                        *v = specials[(i / 2 / 3) % specials.len()];
                    }
                }
                if layout == Layout::Halves {
                    // The last case runs the divided activations, the tiny ones the shifts.
                    let divided = avx2_grouped::Activations::new(
                        std::iter::once((kind, layout)),
                        &x,
                        cols,
                        tokens,
                        cols,
                    )
                    .halves(kind)
                    .is_some();
                    assert_eq!(divided, case == 4 || case == 5, "case {case}");
                }
                let mut reference = vec![0f32; tokens * rows];
                let mut vector = reference.clone();
                for (out, avx2) in [(&mut reference, false), (&mut vector, true)] {
                    let job = bare_job(&w, &x, cols, tokens, 0..rows, out, rows, false);
                    unsafe {
                        if avx2 {
                            avx2_grouped::rows(m, &job)
                        } else {
                            grouped::rows_ref(m, &job)
                        }
                    }
                }
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&vector),
                    bits(&reference),
                    "{kind:?} {layout:?} {rows}x{cols} x{tokens}, case {case}"
                );
            }
        }
    }
}

/// [`Numerics::Int16`] and [`Numerics::Int24`] on grouped Q4_0/Q4_1/Q5_0/Q8_0/Q4_K weights
/// ([`grouped_i16`]): the AVX512-VNNI kernel equals the scalar chain bit for bit (row ranges
/// that cut groups, bias, accumulation, 1 to 40 tokens: passes of one token's chains, of several
/// tokens, chunks of 8 and rests); the entry point gives those bits (int16 at every level, below
/// the kernel's through the scalar chain, in calls of every size; int24 at the kernel's, in
/// calls of up to 16 tokens), each token alone the same bits as in the call; and the chain is the f64 product of the
/// dequantized weights with the activations within the rounding of the activations to 16 or 24
/// bits and of the f32 sums.
#[test]
fn grouped_int16_kernel_matches_the_reference() {
    if simd::level() < Level::Avx2 {
        println!("SKIPPED: this CPU has no AVX2, so Numerics::Int16 runs the exact kernels");
        return;
    }
    let vnni = avx512_grouped_i16::available();
    if !vnni {
        println!("SKIPPED (AVX512-VNNI grouped int16 kernel): not on this CPU");
    }
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    if !avx512_grouped_i16::gathers() {
        println!("SKIPPED (grouped int16 Q8_0): this CPU has no AVX512-VBMI, Q8_0 runs exact");
    }
    let kinds = [
        (QuantKind::Q4_0, Layout::Streams),
        (QuantKind::Q4_1, Layout::Streams),
        (QuantKind::Q8_0, Layout::Streams),
        (QuantKind::Q5_0, Layout::Planes),
        (QuantKind::Q4_K, Layout::Streams),
    ];
    for (kind, layout) in kinds
        .into_iter()
        .filter(|&(k, _)| k != QuantKind::Q8_0 || avx512_grouped_i16::gathers())
    {
        for (rows, cols, tokens) in [
            (1, 32, 1),
            (16, 64, 3),
            (37, 96, 1),
            (40, 160, 5),
            (70, 64, 8),
            (33, 576, 2),
            (20, 96, 13),
            (48, 64, 16),
            (33, 4864, 1),
            // Prefill-sized calls take the same products (a token's bits never depend on
            // how many rows its call held).
            (17, 576, 17),
            (36, 96, 40),
        ] {
            let cols = whole_blocks(kind, cols);
            let seed = (rows * 100 + cols + tokens) as u64 + 7;
            let w = regrouped_in(quant_matrix(kind, rows, cols, true, seed), layout);
            let WeightData::Grouped(m) = &w.data else {
                unreachable!()
            };
            let ldx = cols + 3;
            let mut x = rand_vec((tokens - 1) * ldx + cols, seed + 2);
            // A block of zeros and one of a single large value among small ones.
            x[..32].fill(0.0);
            if cols >= 64 {
                x[40] = 1e4;
            }
            for (width, numerics) in [
                (grouped_i16::Width::Int16, Numerics::Int16),
                (grouped_i16::Width::Int24, Numerics::Int24),
            ] {
                let split: Vec<grouped_i16::Split> = (0..tokens)
                    .map(|t| grouped_i16::split_ref(&x[t * ldx..t * ldx + cols], width))
                    .collect();
                let out0 = rand_vec(tokens * rows, seed + 3);
                for acc in [false, true] {
                    let mut reference = out0.clone();
                    let mut vector = out0.clone();
                    for rg in row_cuts(rows) {
                        for (out, kernel) in [(&mut reference, false), (&mut vector, true)] {
                            if kernel && !vnni {
                                continue;
                            }
                            let job = Job {
                                x16g: Some(&split),
                                ..bare_job(&w, &x, ldx, tokens, rg.clone(), out, rows, acc)
                            };
                            unsafe {
                                if kernel {
                                    avx512_grouped_i16::rows(m, &split, &job)
                                } else {
                                    grouped_i16::rows_ref(m, &split, &job)
                                }
                            }
                        }
                    }
                    if vnni {
                        assert_eq!(
                            bits(&vector),
                            bits(&reference),
                            "{kind:?} {width:?} {rows}x{cols} x{tokens} acc {acc}"
                        );
                    }
                    // Within the activations' rounding of the f64 product: each product off by at
                    // most |w|·d/2, d the block's scale.
                    let wf = weights_f64(&w);
                    for t in 0..tokens {
                        for n in 0..rows {
                            let mut want = if acc { out0[t * rows + n] as f64 } else { 0.0 };
                            want += w.bias.as_ref().map_or(0.0, |b| b[n] as f64);
                            let (mut mag, mut bound) = (want.abs(), 0f64);
                            for k in 0..cols {
                                let xv = x[t * ldx + k] as f64;
                                want += wf[n * cols + k] * xv;
                                mag += (wf[n * cols + k] * xv).abs();
                                let b = k / 32 * 32;
                                let amax = x[t * ldx + b..t * ldx + b + 32]
                                    .iter()
                                    .fold(0f32, |a, v| a.max(v.abs()));
                                bound += wf[n * cols + k].abs() * amax as f64
                                    / width.qmax() as f64
                                    / 2.0;
                            }
                            let got = reference[t * rows + n] as f64;
                            // The f32 sums' rounding: at 24 bits the activations' is smaller.
                            let sums = if width == grouped_i16::Width::Int24 {
                                1e-6
                            } else {
                                1e-5
                            };
                            assert!(
                            (got - want).abs() <= bound * 1.01 + sums * mag,
                            "{kind:?} {width:?} {rows}x{cols} out[{t},{n}] = {got}, want {want} \
                             (bound {bound}, mag {mag})"
                        );
                        }
                    }
                    // The entry point, at the CPU's level and below the kernel's (int16), and each
                    // token alone. Int24 runs the exact kernels below its kernel's level.
                    let what = format!("{kind:?} {width:?} {rows}x{cols} x{tokens}");
                    if numerics == Numerics::Int16 {
                        assert_entry_point_bits(
                            numerics,
                            (&w, &x, ldx, tokens),
                            (&out0, &reference, acc),
                            &what,
                        );
                    } else if vnni && tokens <= grouped::MAX_TOKENS {
                        // (Larger int24 calls run the exact panels.)
                        assert_entry_point_bits_at(
                            &[simd::level()],
                            numerics,
                            (&w, &x, ldx, tokens),
                            (&out0, &reference, acc),
                            &what,
                        );
                    }
                    if layout == Layout::Planes
                        && numerics == Numerics::Int24
                        && tokens > grouped::MAX_TOKENS
                    {
                        // Larger int24 calls run the exact panels on dequantized tiles: the
                        // planes layout's tiles are the streams layout's values, so the bits
                        // are those of exact products of the streams layout.
                        let streams = regrouped_in(
                            quant_matrix(kind, rows, cols, true, seed),
                            Layout::Streams,
                        );
                        for level in [simd::level(), Level::Avx2] {
                            let mut want = out0.clone();
                            let (n, e) = (Numerics::Exact, &streams);
                            matmul_with(level, n, e, &x, ldx, tokens, &mut want, rows, acc);
                            let mut got = out0.clone();
                            matmul_with(level, numerics, &w, &x, ldx, tokens, &mut got, rows, acc);
                            assert_eq!(bits(&got), bits(&want), "{what}: {} exact", level.name());
                        }
                    }
                }
            }
        }
    }
}
