//! The CPU interpreter on the small hand-built program: any order the waits allow gives the
//! same bits, and dropping any wait the others do not imply is caught (a poisoned read or a
//! different result) by an order that runs the waiting tile before the producer.

use kiln_codegen::interp::{
    adversarial_picker, f32_to_bf16, unordered_producers, InterpError, Machine, SplitMix,
    WeightData,
};
use kiln_codegen::*;

mod common;
use common::small;

const BLOCK_SIZE: usize = 4;
const MAX_BLOCKS: usize = 4;
const NUM_BLOCKS: usize = 12;
/// Each batch row's page table: blocks in scrambled order, none shared.
const TABLES: [[i32; MAX_BLOCKS]; 2] = [[7, 2, 10, 5], [3, 11, 0, 8]];

/// Random weights, a cache holding `pos[b]` positions of each row (5 and 3) through its page
/// table.
fn machine(p: &DecodeProgram, s: &Schedule) -> Machine {
    let mut rng = SplitMix(7);
    let mut r = move || (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0;
    let weights = p
        .weights
        .iter()
        .map(|w| match w.dtype {
            WeightDtype::Bf16 => WeightData::Bf16(
                (0..w.rows * w.cols)
                    .map(|_| f32_to_bf16(r() * 0.5))
                    .collect(),
            ),
            WeightDtype::F32 => {
                WeightData::F32((0..w.rows * w.cols).map(|_| 1.0 + 0.1 * r()).collect())
            }
        })
        .collect();
    let inv_freq: Vec<f32> = (0..p.head_dim / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / p.head_dim as f32))
        .collect();
    let geometry = (NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS);
    let mut m = Machine::new(p, s, weights, geometry, inv_freq).unwrap();
    let kvd = p.kv_heads * p.head_dim;
    let lens = [5usize, 3];
    for (b, &len) in lens.iter().enumerate().take(p.batch) {
        let table = TABLES[b];
        m.tables[b * MAX_BLOCKS..(b + 1) * MAX_BLOCKS].copy_from_slice(&table);
        for layer in 0..p.layers {
            for pos in 0..len {
                let k: Vec<f32> = (0..kvd).map(|_| r()).collect();
                let v: Vec<f32> = (0..kvd).map(|_| r()).collect();
                let block = table[pos / BLOCK_SIZE] as usize;
                m.write_kv(layer, block, pos % BLOCK_SIZE, &k, &v);
            }
        }
        m.pos[b] = len as i32;
        m.tokens[b] = (11 + 17 * b) as i32;
    }
    m
}

/// Logits and tokens of each of `steps` steps, the final caches, or the interpreter's error.
type Run = Result<
    (
        Vec<Vec<Vec<f32>>>,
        Vec<Vec<i32>>,
        Vec<u16>,
        Vec<u16>,
        Vec<u32>,
    ),
    InterpError,
>;

fn run(
    p: &DecodeProgram,
    s: &Schedule,
    steps: usize,
    pick: &mut dyn FnMut(&[usize]) -> usize,
) -> Run {
    let (offs, _) = p.buffer_offsets();
    let Some(Instr::Sample { logits, .. }) = p.instrs.iter().rev().nth(1) else {
        panic!("no sample");
    };
    let mut m = machine(p, s);
    let (mut ls, mut toks) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        m.step(pick)?;
        ls.push(m.rows(
            offs[logits.buf],
            p.buffers[logits.buf].cols,
            logits.col,
            logits.cols,
        ));
        toks.push(m.tokens.clone());
    }
    Ok((
        ls,
        toks,
        m.k_cache.clone(),
        m.v_cache.clone(),
        m.ring.clone(),
    ))
}

#[test]
fn every_order_the_waits_allow_gives_the_same_bits() {
    for batch in [1, 2] {
        let p = small(batch);
        let s = Schedule::build(&p, TileConfig::default());
        let want = run(&p, &s, 4, &mut |r: &[usize]| {
            (0..r.len()).min_by_key(|&i| r[i]).unwrap()
        })
        .unwrap();
        assert!(want.0.iter().flatten().flatten().all(|v| v.is_finite()));
        for seed in 1..6 {
            let mut rng = SplitMix(seed);
            let got = run(&p, &s, 4, &mut rng.picker()).unwrap();
            assert!(got == want, "batch {batch} seed {seed}");
        }
    }
}

#[test]
fn dropping_any_essential_wait_is_detected() {
    let p = small(2);
    let s = Schedule::build(&p, TileConfig::default());
    let want = run(&p, &s, 2, &mut SplitMix(1).picker()).unwrap();
    let (mut essential, mut missed) = (0, Vec::new());
    for t in 0..s.tiles.len() {
        for k in 0..s.tiles[t].waits.len() {
            let avoid = unordered_producers(&s, t, k);
            if avoid.is_empty() {
                continue;
            }
            essential += 1;
            let mut m = s.clone();
            m.tiles[t].waits.remove(k);
            let got = run(&p, &m, 2, &mut adversarial_picker(t, avoid, t as u64));
            if got.as_ref().ok() == Some(&want) {
                missed.push((t, p.instrs[s.tiles[t].instr].name(), s.tiles[t].waits[k]));
            }
        }
    }
    assert!(essential > 20, "{essential} essential waits");
    assert!(missed.is_empty(), "undetected dropped waits: {missed:?}");
}

/// Embedding → act → mul → softcap → combine → LM head: each elementwise op's values checked
/// against a direct computation from the embedding row.
#[test]
fn elementwise_ops_compute_what_they_name() {
    let mut p = DecodeProgram::new(1, RopeStyle::HalfSplit);
    p.vocab = 8;
    let d = 64;
    let emb = p.weight("embed", 8, d);
    let x = p.buffer("x", d);
    p.instrs.push(Instr::Embed { table: emb, out: x });
    let mut prev = ColRange::whole(x, d);
    let mut outs = Vec::new();
    for (name, op, binary) in [
        ("act", Ewise::Act(Act::Silu), false),
        ("relu2", Ewise::Act(Act::ReluSquared), false),
        ("mul", Ewise::Mul, true),
        ("softcap", Ewise::Softcap(0.3), false),
        ("combine", Ewise::Combine { a: 0.5, b: -2.0 }, true),
    ] {
        let o = p.buffer(name, d);
        p.instrs.push(Instr::Elementwise {
            op,
            x: prev,
            y: binary.then(|| ColRange::whole(x, d)),
            out: o,
        });
        prev = ColRange::whole(o, d);
        outs.push(o);
    }
    let logits = p.buffer("logits", 8);
    p.instrs.push(Instr::LmHead {
        norm: None,
        weight: emb,
        bias: None,
        input: prev,
        out: logits,
        softcap: None,
    });
    p.instrs.push(Instr::Sample {
        logits: ColRange::whole(logits, 8),
    });
    p.instrs.push(Instr::StepEnd);
    p.validate().unwrap();
    let s = Schedule::build(
        &p,
        TileConfig {
            matvec_rows: 32,
            elem_cols: 24,
            stage_bytes: 0,
            head_rows: 0,
        },
    );
    let table: Vec<u16> = (0..8 * d)
        .map(|i| f32_to_bf16(((i * 37 % 101) as f32 - 50.0) / 40.0))
        .collect();
    let weights = vec![WeightData::Bf16(table.clone())];
    let mut m = Machine::new(&p, &s, weights, (1, 4, 1), vec![]).unwrap();
    m.tokens[0] = 3;
    m.step(&mut SplitMix(3).picker()).unwrap();
    let (offs, _) = p.buffer_offsets();
    let e: Vec<f32> = table[3 * d..4 * d]
        .iter()
        .map(|&b| kiln_codegen::interp::bf16_to_f32(b))
        .collect();
    let silu: Vec<f32> = e.iter().map(|v| v / (1.0 + (-v).exp())).collect();
    let relu2: Vec<f32> = silu.iter().map(|v| v.max(0.0) * v.max(0.0)).collect();
    let mul: Vec<f32> = relu2.iter().zip(&e).map(|(a, b)| a * b).collect();
    let cap: Vec<f32> = mul.iter().map(|v| 0.3 * (v / 0.3).tanh()).collect();
    let comb: Vec<f32> = cap.iter().zip(&e).map(|(a, b)| 0.5 * a - 2.0 * b).collect();
    for (o, want) in outs.iter().zip([silu, relu2, mul, cap, comb]) {
        assert_eq!(
            m.act[offs[*o]..offs[*o] + d],
            want[..],
            "{}",
            p.buffers[*o].name
        );
    }
}
