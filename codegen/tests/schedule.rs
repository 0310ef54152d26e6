//! CPU tests of the tile schedule and the emitter on a small hand-built program.

use kiln_codegen::*;

mod common;
use common::small;

#[test]
fn tile_counts_follow_the_tile_sizes() {
    let p = small(1);
    let s = Schedule::build(&p, TileConfig::default());
    let counts: Vec<usize> = (0..p.instrs.len()).map(|i| s.tiles_of_instr(i)).collect();
    // embed 1; per layer: qkv 2+1+1, rope 4 heads, kv 2 heads, attn 4 heads, o 2, mlp 3, down 2;
    // lm head 4 (100 rows / 32), sample 1, end 1.
    assert_eq!(
        counts,
        vec![1, 4, 4, 2, 4, 2, 3, 2, 4, 4, 2, 4, 2, 3, 2, 4, 1, 1]
    );
    // No matvec tile straddles two weights.
    let qkv: Vec<(usize, usize, usize)> = s.tiles[1..5]
        .iter()
        .map(|t| (t.segment, t.lo, t.hi))
        .collect();
    assert_eq!(qkv, vec![(0, 0, 32), (0, 32, 64), (1, 0, 32), (2, 0, 32)]);
}

#[test]
fn head_rows_size_the_lm_head_alone() {
    let p = small(1);
    let base = TileConfig::default();
    let counts = |cfg: TileConfig| -> Vec<usize> {
        let s = Schedule::build(&p, cfg);
        (0..p.instrs.len()).map(|i| s.tiles_of_instr(i)).collect()
    };
    let default = counts(base);
    // 0: the matvec size (100 rows / 32 = 4 tiles).
    assert_eq!(default[15], 4);
    // 50 rows a tile: the LM head's 100 rows in 2 tiles, every other instruction as before.
    let wide = counts(TileConfig {
        head_rows: 50,
        ..base
    });
    let mut want = default.clone();
    want[15] = 2;
    assert_eq!(wide, want);
    // Capped by the staging buffer like a matvec: 16 columns of bf16 are 32 bytes a row.
    let k = match &p.instrs[15] {
        Instr::LmHead { weight, .. } => p.weights[*weight].cols,
        other => panic!("instruction 15 is {}, not the LM head", other.name()),
    };
    let capped = TileConfig {
        head_rows: 50,
        stage_bytes: 10 * 2 * k,
        ..base
    };
    assert_eq!(capped.head_rows_for(k), 10);
    assert_eq!(counts(capped)[15], 10);
}

#[test]
fn dependencies_are_exactly_the_overlapping_earlier_tiles() {
    for batch in [1, 4] {
        let p = small(batch);
        let s = Schedule::build(&p, TileConfig::default());
        let n = s.tiles.len();
        for (t, expect) in s.pairwise_deps(&p).iter().enumerate() {
            assert_eq!(&s.tiles[t].deps, expect, "tile {t}");
        }
        // Fine-grained: attention head 0 (kv group 0) waits on rope head 0 and kv head 0 only.
        let att0 = s.instr_first[4];
        let rope0 = s.instr_first[2];
        let kv0 = s.instr_first[3];
        let t = &s.tiles[att0];
        assert!(t.deps.contains(&rope0) && t.deps.contains(&kv0));
        assert!(!t.deps.contains(&(rope0 + 1)) && !t.deps.contains(&(kv0 + 1)));
        // Its waits are per-tile counters (target e), not instruction barriers.
        assert!(t.waits.iter().all(|w| w.per_step == 1));
        // The o projection reads every attention head: one instruction-counter wait, on one
        // tile per (row, head).
        assert_eq!(s.tiles_of_instr(4), 4 * batch);
        let o0 = &s.tiles[s.instr_first[5]];
        assert!(o0.waits.contains(&Wait {
            counter: 4,
            per_step: 4 * batch as u32
        }));
        // The sample tile is read-after-write on tokens vs the embedding: the embedding waits on
        // nothing in-step, sample waits (transitively and directly) on the lm head.
        assert!(s.tiles[0].deps.is_empty());
        // StepEnd waits on the sample tile (a sink) and every pos reader (write after read).
        let end = s.tiles.last().unwrap();
        assert!(end.deps.contains(&(n - 2)));
    }
}

/// Sampling is one tile per batch row, so the rows sample in parallel: tile b reads only
/// position b and writes only token b, none waits on another, and the step end (which copies
/// every token into the ring) waits on all of them through one instruction-counter wait.
#[test]
fn sample_tiles_are_per_row_and_the_step_end_waits_for_all() {
    let p = small(8);
    let s = Schedule::build(&p, TileConfig::default());
    let si = p.instrs.len() - 2;
    assert_eq!(s.tiles_of_instr(si), 8);
    let first = s.instr_first[si];
    let lm_head = si - 1;
    for b in 0..8 {
        let t = &s.tiles[first + b];
        assert_eq!((t.lo, t.hi), (b, b + 1));
        let row = |res| Access {
            res,
            lo: b,
            hi: b + 1,
        };
        assert!(t.reads.contains(&row(Resource::Pos)));
        assert_eq!(t.writes, vec![row(Resource::Tokens)]);
        assert!(
            t.deps.iter().all(|&d| d < first),
            "tile {b} waits on a sample tile"
        );
        assert!(t.waits.contains(&Wait {
            counter: lm_head,
            per_step: s.tiles_of_instr(lm_head) as u32
        }));
    }
    let end = s.tiles.last().unwrap();
    assert!((first..first + 8).all(|t| end.deps.contains(&t)));
    assert!(end.waits.contains(&Wait {
        counter: si,
        per_step: 8
    }));
}

#[test]
fn epoch_targets_are_epoch_times_producer_tiles() {
    let p = small(1);
    let s = Schedule::build(&p, TileConfig::default());
    let n_instr = p.instrs.len();
    for t in &s.tiles {
        for w in &t.waits {
            if w.counter < n_instr {
                assert_eq!(w.per_step as usize, s.tiles_of_instr(w.counter));
            } else {
                assert_eq!(w.per_step, 1);
            }
            for e in [1u32, 2, 7] {
                assert_eq!(w.target(e), e * w.per_step);
            }
        }
    }
}

#[test]
fn simulation_terminates_in_topological_order_for_several_block_counts() {
    for batch in [1, 8] {
        let p = small(batch);
        let s = Schedule::build(&p, TileConfig::default());
        for blocks in [1usize, 2, 7, 132] {
            let orders = s
                .simulate(blocks, 3)
                .unwrap_or_else(|e| panic!("{blocks} blocks: {e}"));
            assert_eq!(orders.len(), 3);
            for order in &orders {
                assert_eq!(order.len(), s.tiles.len());
                let mut at = vec![usize::MAX; s.tiles.len()];
                for (k, &t) in order.iter().enumerate() {
                    at[t] = k;
                }
                for (t, tile) in s.tiles.iter().enumerate() {
                    for &d in &tile.deps {
                        assert!(at[d] < at[t], "{blocks} blocks: tile {t} before dep {d}");
                    }
                }
                assert_eq!(*order.last().unwrap(), s.tiles.len() - 1, "step end last");
            }
        }
    }
}

#[test]
fn a_wait_on_a_later_tile_is_a_detected_deadlock() {
    let p = small(1);
    let mut s = Schedule::build(&p, TileConfig::default());
    // Make tile 0 wait on the step end's counter: nothing can move.
    let end = s.tiles.len() - 1;
    s.tiles[0].waits.push(Wait {
        counter: p.instrs.len() + end,
        per_step: 1,
    });
    assert!(s.simulate(2, 1).unwrap_err().contains("deadlock"));
}

#[test]
fn emitted_kernel_matches_the_snapshot() {
    let p = small(2);
    let s = Schedule::build(&p, TileConfig::default());
    let text = emit_kernel(&p, &s);
    assert_eq!(text, emit_kernel(&p, &s), "deterministic");
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/snapshots/small_batch2.cu"
    );
    if std::env::var_os("KILN_UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(std::path::Path::new(path).parent().unwrap()).unwrap();
        std::fs::write(path, &text).unwrap();
    }
    let want =
        std::fs::read_to_string(path).expect("snapshot missing: run with KILN_UPDATE_SNAPSHOTS=1");
    assert_eq!(
        text, want,
        "generated kernel changed; review and rerun with KILN_UPDATE_SNAPSHOTS=1"
    );
    let full = emit_source(&p, &s);
    assert!(full.contains("__device__ __forceinline__ float block_sum"));
    assert!(full
        .contains("extern \"C\" __global__ void __launch_bounds__(MK_THREADS)\nkiln_decode_step("));
}
