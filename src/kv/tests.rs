use super::*;

fn spec() -> KvSpec {
    KvSpec {
        layers: 2,
        kv_heads: 2,
        head_dim: 3,
        state_dim: 2,
    }
}

fn cache(slots: usize, capacity: usize) -> KvCache {
    KvCache::new(spec(), slots, capacity).expect("cache")
}

/// Keys/values of one head for positions `0..len`, read through the page table.
fn head(c: &KvCache, layer: usize, slot: usize, h: usize, len: usize) -> (Vec<f32>, Vec<f32>) {
    let l = *c.layout();
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for pos in 0..len {
        let (b, off) = l.locate(c.page_table(slot), pos);
        let (kb, vb) = c.pool().head_block_f32(layer, b as u32, h);
        k.extend_from_slice(&kb[off * l.head_dim..(off + 1) * l.head_dim]);
        v.extend_from_slice(&vb[off * l.head_dim..(off + 1) * l.head_dim]);
    }
    (k, v)
}

fn fill(c: &mut KvCache, slot: usize, from: usize, to: usize, base: f32) {
    c.prepare(slot, to).expect("prepare");
    for pos in from..to {
        for layer in 0..2 {
            let k: Vec<f32> = (0..6)
                .map(|i| base + (layer * 1000 + pos * 10 + i) as f32)
                .collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            c.write(layer, slot, pos, &k, &v);
        }
        c.write_state(slot, pos, &[base + pos as f32, 0.5]);
    }
    c.advance(slot, to - from);
}

#[test]
fn writes_land_per_head_and_copy_between_slots() {
    let mut c = cache(2, 40);
    c.reserve(0, 4).unwrap();
    fill(&mut c, 0, 0, 20, 0.0);
    let (k, v) = head(&c, 1, 0, 1, 20);
    assert_eq!(&k[..6], &[1003.0, 1004.0, 1005.0, 1013.0, 1014.0, 1015.0]);
    assert_eq!(&v[..3], &[-1003.0, -1004.0, -1005.0]);
    assert_eq!(c.state(0, 17), &[17.0, 0.5]);
    c.copy_slot(0, 1, 20);
    assert_eq!(c.len(1), 20);
    assert_eq!(c.state(1, 17), &[17.0, 0.5]);
    assert_eq!(head(&c, 1, 1, 1, 20), (k.clone(), v.clone()));
    // Sharing, not copying: the full block and the partial one are the same blocks.
    assert_eq!(c.page_table(0), c.page_table(1));
    c.check_invariants().unwrap();
    // Writing position 20 of slot 1 copies the shared partial block first; slot 0 keeps its
    // own contents.
    fill(&mut c, 1, 20, 21, 500.0);
    assert_eq!(c.page_table(0)[0], c.page_table(1)[0]);
    assert_ne!(c.page_table(0)[1], c.page_table(1)[1]);
    assert_eq!(head(&c, 1, 0, 1, 20), (k.clone(), v));
    assert_eq!(&head(&c, 1, 1, 1, 20).0, &k);
    assert_eq!(c.state(1, 20), &[520.0, 0.5]);
    c.check_invariants().unwrap();
}

#[test]
fn full_cache_is_an_error_not_a_silent_overwrite() {
    let mut c = cache(1, 4);
    fill(&mut c, 0, 0, 3, 0.0);
    assert_eq!(
        c.reserve(0, 2),
        Err(KvError::Full {
            slot: 0,
            len: 3,
            capacity: 4,
            needed: 2
        })
    );
    assert!(c.reserve(0, 1).is_ok());
    assert!(matches!(c.reserve(5, 1), Err(KvError::NoSlot { .. })));
    assert!(matches!(c.prepare(0, 5), Err(KvError::Full { .. })));
}

#[test]
fn an_exhausted_pool_is_an_error() {
    let mut c = KvCache::with_budget(
        spec(),
        KvOptions {
            block_size: 4,
            dtype: KvDtype::F32,
        },
        KvBudget::Blocks(2),
        100,
    )
    .unwrap();
    let s = c.open_slot();
    fill(&mut c, s, 0, 8, 0.0);
    assert!(matches!(
        c.prepare(s, 9),
        Err(KvError::Pool(PoolError::Exhausted { blocks: 2 }))
    ));
    c.truncate(s, 3);
    assert_eq!(c.pool().free_blocks(), 1);
    c.check_invariants().unwrap();
}

#[test]
fn absurd_sizes_are_errors_or_lazy_not_aborts() {
    // A context of 2^62 positions: the ceiling is clamped and nothing is allocated up front.
    let c = KvCache::new(spec(), 1, 1 << 62).unwrap();
    assert_eq!(c.bytes(), 0);
    let huge = KvSpec {
        layers: 1,
        kv_heads: 1,
        head_dim: 1 << 62,
        state_dim: 0,
    };
    assert!(KvCache::new(huge, 1, 16).is_err());
}

#[test]
fn prefixes_are_shared_through_the_cache_and_evicted_lru() {
    let bs = 4;
    let mut c = KvCache::with_budget(
        spec(),
        KvOptions {
            block_size: bs,
            dtype: KvDtype::F32,
        },
        KvBudget::Blocks(6),
        64,
    )
    .unwrap();
    let toks: Vec<u32> = (0..10).collect();
    let a = c.open_slot();
    fill(&mut c, a, 0, 10, 0.0);
    c.publish_prefix(a, &toks);
    assert_eq!(c.prefix_blocks(), 2);
    let b = c.open_slot();
    // One position short of the prompt must stay uncomputed: 9 positions → 2 blocks.
    assert_eq!(c.attach_prefix(b, &toks, 9).unwrap(), 8);
    assert_eq!(head(&c, 0, b, 1, 8), head(&c, 0, a, 1, 8));
    assert_eq!(c.state(b, 7), &[7.0, 0.5]);
    // A different second block: only the first is shared.
    let mut other = toks.clone();
    other[5] = 99;
    let d = c.open_slot();
    assert_eq!(c.attach_prefix(d, &other, 9).unwrap(), 4);
    c.check_invariants().unwrap();
    c.close_slot(a);
    c.close_slot(b);
    c.close_slot(d);
    assert_eq!(c.available_blocks(), 6);
    // Filling the pool evicts the cached prefix (leaf first) instead of failing.
    let e = c.open_slot();
    fill(&mut c, e, 0, 24, 1.0);
    assert_eq!(c.prefix_blocks(), 0);
    c.check_invariants().unwrap();
}

/// Randomized alloc / fork / append / truncate / free / publish / attach / evict, checking
/// reference counts, the free list and the prefix tree after every operation, and that every
/// slot still reads back what was written to it.
#[test]
fn pool_stress_keeps_every_invariant() {
    let bs = 4;
    let mut c = KvCache::with_budget(
        spec(),
        KvOptions {
            block_size: bs,
            dtype: KvDtype::F32,
        },
        KvBudget::Blocks(40),
        48,
    )
    .unwrap();
    // Per slot: the tokens it holds; a position's K value is a function of the token and
    // position only, so shared prefixes read back the same.
    let mut held: Vec<Option<Vec<u32>>> = Vec::new();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let write_pos = |c: &mut KvCache, slot: usize, pos: usize, tok: u32| {
        for layer in 0..2u32 {
            let k: Vec<f32> = (0..6)
                .map(|i| (tok * 100 + pos as u32 * 7 + i + layer * 3) as f32)
                .collect();
            c.write(layer as usize, slot, pos, &k, &k);
        }
        c.write_state(slot, pos, &[tok as f32, pos as f32]);
    };
    let mut ops = [0usize; 8];
    for step in 0..4000 {
        let open: Vec<usize> = (0..held.len()).filter(|&s| held[s].is_some()).collect();
        let op = next(8) as usize;
        match op {
            0 if open.len() < 8 => {
                let s = c.open_slot();
                if held.len() <= s {
                    held.resize(s + 1, None);
                }
                held[s] = Some(Vec::new());
            }
            1 | 2 if !open.is_empty() => {
                // Append 1..6 tokens from a small alphabet (so prefixes repeat).
                let s = open[next(open.len() as u64) as usize];
                let n = 1 + next(6) as usize;
                let len = c.len(s);
                if len + n <= 48 && c.prepare(s, len + n).is_ok() {
                    for i in 0..n {
                        let tok = next(3) as u32;
                        write_pos(&mut c, s, len + i, tok);
                        held[s].as_mut().unwrap().push(tok);
                    }
                    c.advance(s, n);
                }
            }
            3 if !open.is_empty() => {
                let s = open[next(open.len() as u64) as usize];
                let len = next(c.len(s) as u64 + 1) as usize;
                c.truncate(s, len);
                held[s].as_mut().unwrap().truncate(len);
            }
            4 if open.len() >= 2 => {
                let (a, b) = (
                    open[next(open.len() as u64) as usize],
                    open[next(open.len() as u64) as usize],
                );
                if a != b {
                    let len = next(c.len(a) as u64 + 1) as usize;
                    c.copy_slot(a, b, len);
                    let t = held[a].as_ref().unwrap()[..len].to_vec();
                    held[b] = Some(t);
                }
            }
            5 if !open.is_empty() => {
                let s = open[next(open.len() as u64) as usize];
                let t = held[s].clone().unwrap();
                c.publish_prefix(s, &t);
            }
            6 if !open.is_empty() => {
                let s = open[next(open.len() as u64) as usize];
                let want: Vec<u32> = (0..1 + next(20)).map(|_| next(3) as u32).collect();
                let got = c.attach_prefix(s, &want, want.len()).unwrap();
                held[s] = Some(want[..got].to_vec());
            }
            7 if !open.is_empty() => {
                if next(2) == 0 {
                    let s = open[next(open.len() as u64) as usize];
                    c.close_slot(s);
                    held[s] = None;
                } else {
                    c.evict_prefix(1 + next(4) as usize);
                }
            }
            _ => continue,
        }
        ops[op] += 1;
        if let Err(e) = c.check_invariants() {
            panic!("step {step} (op {op}): {e}");
        }
        for (s, t) in held.iter().enumerate() {
            let Some(t) = t else { continue };
            assert_eq!(c.len(s), t.len(), "step {step}: slot {s} length");
            for (pos, &tok) in t.iter().enumerate() {
                assert_eq!(
                    c.state(s, pos),
                    &[tok as f32, pos as f32],
                    "step {step}: slot {s} pos {pos}"
                );
                let (b, off) = c.layout().locate(c.page_table(s), pos);
                let k = &c.pool().head_block_f32(1, b as u32, 1).0[off * 3..off * 3 + 3];
                assert_eq!(k[0], (tok * 100 + pos as u32 * 7 + 3 + 3) as f32);
            }
        }
    }
    assert!(ops.iter().all(|&n| n > 100), "every operation ran: {ops:?}");
}

/// A tables-only cache hands out the same blocks as a full one, takes no data memory, and
/// `make_writable` from before the length copies exactly the shared blocks it will write (the
/// copies a device mirror replays), adding blocks up to `end`.
#[test]
fn tables_only_cache_reports_its_copy_on_write_copies() {
    let opts = KvOptions {
        block_size: 4,
        dtype: KvDtype::Bf16,
    };
    let mut c = KvCache::tables_only(spec(), opts, KvBudget::Blocks(16), 24).unwrap();
    let (a, b) = (c.open_slot(), c.open_slot());
    assert!(!c.pool().has_host_data());
    assert_eq!(c.make_writable(a, 0, 10).unwrap(), vec![]);
    c.advance(a, 10);
    assert_eq!(c.page_table(a).len(), 3);
    assert_eq!(c.bytes(), 0);
    c.copy_slot(a, b, 10);
    let shared = c.page_table(a).to_vec();
    // Writing b from position 5 on touches its blocks 1 and 2 (shared), not block 0.
    let copies = c.make_writable(b, 5, 24).unwrap();
    let own = c.page_table(b).to_vec();
    assert_eq!(copies, vec![(shared[1], own[1]), (shared[2], own[2])]);
    assert_eq!(own[0], shared[0]);
    assert_eq!(own.len(), 6);
    assert_eq!(c.page_table(a), &shared[..]);
    c.check_invariants().unwrap();
    assert!(matches!(
        c.make_writable(b, 0, 25),
        Err(KvError::Full { .. })
    ));
}
