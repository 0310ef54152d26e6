//! The decode megakernel: lowering every fixture's decode plan, tile counts, the llama_tied
//! kernel snapshot, and (feature `cuda`) the NVRTC compile gate for sm_90 / sm_80 with no
//! spills, for every fixture and the demo model at batch 1 and 8. Without a GPU the kernel is
//! compiled only (`tests/megakernel_interp.rs` runs its program in the CPU interpreter); on a GPU
//! tests/gpu.rs runs it (docs/gpu-results.md).

mod common;

use std::path::PathBuf;

use kiln::backend::cuda::megakernel::{
    generate, generate_with, lower_decode, stage_weights, Megakernel, MATVEC_ROWS, STAGE_BYTES,
};
use kiln::graph::build::LogitRows;
use kiln::graph::{Epilogue, Norm, Op};
use kiln::model::Model;
use kiln::plan::compile_graph;
use kiln::plan::{ExecutionPlan, Phase};
use kiln_codegen::{Ewise, Instr, LowerError};

fn plan(path: &str) -> ExecutionPlan {
    let m = Model::load(path).unwrap();
    let g = compile_graph(&m.config, &m.weights, LogitRows::Last).unwrap();
    ExecutionPlan::lower(g, Phase::Decode)
}

fn names(k: &Megakernel) -> Vec<(&'static str, usize)> {
    (0..k.program.instrs.len())
        .map(|i| (k.program.instrs[i].name(), k.schedule.tiles_of_instr(i)))
        .collect()
}

#[test]
fn llama_tied_lowers_with_fused_rope_kv_append() {
    // The program without the attention fusion (KILN_MK_FUSE_ATTN=0), whose RoPE and KV append
    // are instructions of their own.
    let k = kiln::backend::cuda::megakernel::generate_with(
        &plan("tests/fixtures/llama_tied"),
        1,
        false,
    )
    .unwrap();
    // Matvec tiles of the GPU's size: q 64 rows, k 32, v 32 (each its own tiles), o 64, gate/up
    // 160, down 64; the head's 400 rows in tiles as large as a staging buffer holds.
    let tiles = |rows: usize| rows.div_ceil(MATVEC_ROWS);
    let head_rows = kiln::backend::cuda::megakernel::tile_config().head_rows_for(64);
    let layer = [
        ("norm_matvec", tiles(64) + 2 * tiles(32)),
        ("rope", 4),
        ("rope_kv_append", 2),
        ("attention_decode", 4),
        ("matvec_residual", tiles(64)),
        ("gated_mlp", tiles(160)),
        ("matvec_residual", tiles(64)),
    ];
    let mut want = vec![("embed", 1)];
    want.extend(layer);
    want.extend(layer);
    want.extend([
        ("lm_head", 400usize.div_ceil(head_rows)),
        ("sample", 1),
        ("step_end", 1),
    ]);
    assert_eq!(names(&k), want);
    assert!(k
        .program
        .instrs
        .iter()
        .all(|i| !matches!(i, Instr::RopeKvAppend { rope: false, .. })));
    for blocks in [1, 2, 7, 132] {
        k.schedule.simulate(blocks, 2).unwrap();
    }
    let text = kiln_codegen::emit_kernel(&k.program, &k.schedule);
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/snapshots/megakernel_llama_tied.cu"
    );
    if std::env::var_os("KILN_UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(std::path::Path::new(path).parent().unwrap()).unwrap();
        std::fs::write(path, &text).unwrap();
    }
    let want = std::fs::read_to_string(path).expect("snapshot missing: KILN_UPDATE_SNAPSHOTS=1");
    assert_eq!(
        text, want,
        "generated kernel changed; review, rerun with KILN_UPDATE_SNAPSHOTS=1"
    );
}

#[test]
fn nanochat_lowers_with_head_norm_and_softcap_fused_into_the_lm_head() {
    for fx in ["tests/fixtures/nanochat", "tests/fixtures/nanochat_A"] {
        let k = generate(&plan(fx), 2).unwrap();
        let n = names(&k);
        assert_eq!(n[0], ("embed", 1), "{fx}");
        assert_eq!(n[1], ("rms_norm", 1), "{fx}");
        assert!(n.contains(&("head_norm", 4)), "{fx}");
        assert!(k
            .program
            .instrs
            .iter()
            .any(|i| matches!(i, Instr::LmHead { softcap: Some(c), .. } if *c == 15.0)));
        // nanochat's k is rotated, then normed: the append does not rotate again.
        assert!(k
            .program
            .instrs
            .iter()
            .all(|i| !matches!(i, Instr::RopeKvAppend { rope: true, .. })));
        for blocks in [1, 7, 132] {
            k.schedule.simulate(blocks, 2).unwrap();
        }
    }
}

/// Fixtures the megakernel refuses (their weighted q/k norm, and Gemma 3's local RoPE table and
/// GELU-tanh; `tests/megakernel_interp.rs` checks the refusals name them).
const NOT_LOWERED: [&str; 4] = ["qwen3", "qwen3.f32.gguf", "gemma3", "gemma3.f32.gguf"];

/// Every fixture model the megakernel lowers (HF directories and GGUF files), by file name.
fn fixture_models() -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(common::fixtures())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("config.json").is_file() || p.extension().is_some_and(|e| e == "gguf"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), p))
        // quant_blocks.gguf holds block-format test tensors, not a model.
        .filter(|(name, _)| !NOT_LOWERED.contains(&name.as_str()) && name != "quant_blocks.gguf")
        .collect();
    out.sort();
    out
}

#[test]
fn every_fixture_lowers_and_its_schedule_terminates() {
    let models = fixture_models();
    assert!(models.len() >= 17, "{} fixture models", models.len());
    for (name, path) in models {
        let plan = plan(path.to_str().unwrap());
        for batch in [1, 8] {
            let k = generate(&plan, batch).unwrap_or_else(|e| panic!("{name} batch {batch}: {e}"));
            for blocks in [1, 5, 132] {
                k.schedule
                    .simulate(blocks, 2)
                    .unwrap_or_else(|e| panic!("{name} batch {batch}, {blocks} blocks: {e}"));
            }
        }
    }
}

/// The schedule's dependencies (found through an index of the earlier tiles' accesses by
/// resource) are exactly the pairwise definition's: every earlier-instruction tile that writes
/// what a tile reads or writes, or reads what it writes, and for the step end every tile with
/// no dependent yet. On every fixture at batch 1 and 8 and with the attention fusion both ways.
#[test]
fn every_fixture_schedule_has_exactly_the_pairwise_dependencies() {
    for (name, path) in fixture_models() {
        let plan = plan(path.to_str().unwrap());
        for (batch, fuse) in [(1, false), (8, false), (1, true)] {
            let Ok(k) = generate_with(&plan, batch, fuse) else {
                continue;
            };
            let (p, s) = (&k.program, &k.schedule);
            for (t, expect) in s.pairwise_deps(p).iter().enumerate() {
                assert_eq!(
                    &s.tiles[t].deps, expect,
                    "{name} batch {batch} fuse {fuse}: tile {t}"
                );
            }
        }
    }
}

#[test]
fn nanochat_era_h_lowers_smear_value_embeddings_and_residual_lambdas() {
    let k = generate(&plan("tests/fixtures/nanochat_H"), 2).unwrap();
    let p = &k.program;
    assert_eq!(p.state_dim, 32);
    let count = |f: &dyn Fn(&Instr) -> bool| p.instrs.iter().filter(|i| f(i)).count();
    assert_eq!(count(&|i| matches!(i, Instr::Smear { .. })), 1);
    assert_eq!(count(&|i| matches!(i, Instr::GatedValueAdd { .. })), 2);
    // Four residual lambdas and the backout.
    assert_eq!(
        count(&|i| matches!(
            i,
            Instr::Elementwise {
                op: Ewise::Combine { .. },
                ..
            }
        )),
        5
    );
    // The value embedding is one tile per KV head, the smear one tile.
    let gva = p
        .instrs
        .iter()
        .position(|i| matches!(i, Instr::GatedValueAdd { .. }))
        .unwrap();
    assert_eq!(k.schedule.tiles_of_instr(gva), p.kv_heads);
}

#[test]
fn qwen2_biases_are_f32_weights_of_the_matvecs() {
    let k = generate(&plan("tests/fixtures/qwen2"), 1).unwrap();
    let p = &k.program;
    let qkv = p
        .instrs
        .iter()
        .find_map(|i| match i {
            Instr::NormMatvec { biases, .. } if !biases.is_empty() => Some(biases.clone()),
            _ => None,
        })
        .expect("a q/k/v matvec with biases");
    assert_eq!(qkv.len(), 3);
    for b in qkv {
        let w = &p.weights[b.expect("each of q, k, v has a bias")];
        assert_eq!(w.dtype, kiln_codegen::WeightDtype::F32, "{}", w.name);
        assert!(w.name.ends_with(".bias"), "{}", w.name);
    }
}

#[test]
fn an_unsupported_matmul_form_is_a_clear_error() {
    // A residual-add matmul with a norm prologue: no model builds one, the lowering refuses it
    // by name instead of emitting a wrong kernel.
    let mut p = plan("tests/fixtures/llama_tied");
    let ins = p
        .instrs
        .iter_mut()
        .find(|i| {
            matches!(
                i.op,
                Op::MatMul {
                    epilogue: Epilogue::ResidualAdd,
                    ..
                }
            )
        })
        .unwrap();
    let label = ins.label.clone();
    if let Op::MatMul { norm, .. } = &mut ins.op {
        *norm = Some(Norm {
            weight: None,
            eps: 1e-5,
        });
    }
    let node = ins.node;
    p.graph.nodes[node].op = ins.op.clone();
    match lower_decode(&p, 1) {
        Err(LowerError::Unsupported { op, label: l }) => {
            assert_eq!(op, "matmul");
            assert_eq!(l, label);
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

/// NVRTC's include directory, or `None` (with a SKIPPED line naming `what`) where NVRTC or the
/// CUDA headers are missing.
#[cfg(feature = "cuda")]
fn nvrtc_or_skip(what: &str) -> Option<std::path::PathBuf> {
    use kiln::backend::cuda::nvrtc;
    if let Err(e) = nvrtc::ensure_loaded() {
        println!("SKIPPED {what}: {e}");
        return None;
    }
    let include = nvrtc::find_include_dir();
    if include.is_none() {
        println!("SKIPPED {what}: cuda_bf16.h not found");
    }
    include
}

/// Compiles `text` as `file` for sm_90 and asserts that no function spills; returns NVRTC's log.
#[cfg(feature = "cuda")]
fn compile_without_spills(file: String, text: String, include: &std::path::Path) -> String {
    use kiln::backend::cuda::kernels::CudaSource;
    use kiln::backend::cuda::nvrtc;
    let src = CudaSource {
        file: Box::leak(file.clone().into_boxed_str()),
        text: Box::leak(text.into_boxed_str()),
        kernels: &["kiln_decode_step"],
    };
    let c = nvrtc::compile(&src, 90, include).unwrap_or_else(|e| panic!("{file}: {e}"));
    for f in &c.kernels {
        assert_eq!(
            (f.spill_stores, f.spill_loads),
            (0, 0),
            "{file}: {}",
            f.name
        );
    }
    c.log
}

#[cfg(feature = "cuda")]
fn nvrtc_gate(with_smol: bool) {
    use kiln::backend::cuda::kernels::CudaSource;
    use kiln::backend::cuda::nvrtc;
    let Some(include) = nvrtc_or_skip("megakernel nvrtc gate") else {
        return;
    };
    let mut models: Vec<(String, String)> = vec![];
    if !with_smol {
        for (name, path) in fixture_models() {
            models.push((name, path.to_string_lossy().into_owned()));
        }
    }
    let smol = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if !with_smol {
    } else if std::path::Path::new(smol).is_file() {
        models.push(("smollm2-135m".into(), smol.to_string()));
    } else {
        println!("note: {smol} absent, SmolLM2 shapes not compiled");
    }
    // Programs of the same shapes (a model and its GGUF conversions) emit the same source:
    // each distinct source is compiled once.
    let mut seen = std::collections::HashSet::new();
    let mut failures = Vec::new();
    for (name, path) in models {
        for batch in [1usize, 8] {
            let k = generate(&plan(&path), batch).unwrap();
            if !seen.insert(k.source.clone()) {
                println!("{name} batch {batch}: same source as an earlier model");
                continue;
            }
            let src = CudaSource {
                file: Box::leak(format!("megakernel_{name}_b{batch}.cu").into_boxed_str()),
                text: Box::leak(k.source.into_boxed_str()),
                kernels: &["kiln_decode_step"],
            };
            for arch in [90u32, 80] {
                match nvrtc::compile(&src, arch, &include) {
                    Err(e) => failures.push(e.to_string()),
                    Ok(c) => {
                        let r = c.kernels.iter().find(|r| r.name == "kiln_decode_step");
                        let Some(r) = r else {
                            failures.push(format!("{name}: no ptxas report\n{}", c.log));
                            continue;
                        };
                        println!(
                            "sm_{arch} {name} batch {batch}: {} tiles, kiln_decode_step {} regs, {} smem, {} stack, spill {}/{}",
                            k.schedule.tiles.len(), r.registers, r.shared_bytes, r.stack_bytes, r.spill_stores, r.spill_loads
                        );
                        for f in &c.kernels {
                            if f.spill_stores > 0 || f.spill_loads > 0 {
                                failures.push(format!(
                                    "{name} sm_{arch}: {} spills ({} / {})",
                                    f.name, f.spill_stores, f.spill_loads
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[cfg(feature = "cuda")]
#[test]
fn generated_megakernel_compiles_for_sm90_and_sm80_without_spills() {
    nvrtc_gate(false);
}

/// The matvec weight staging can be compiled out for measuring it (`KILN_MK_STAGE=0` puts
/// `#define MK_STAGE 0` ahead of the source): that variant compiles without spills too and is
/// launched with no dynamic shared memory; the default source stages, defines the buffer's size
/// from the schedule and is launched with it.
#[cfg(feature = "cuda")]
#[test]
fn megakernel_without_weight_staging_compiles() {
    let k = generate(&plan("tests/fixtures/llama_tied"), 1).unwrap();
    assert!(k.source.contains("mk_stage_tile(t + gridDim.x, wt, "));
    assert!(k
        .source
        .contains(&format!("#define MK_STAGE_BYTES {STAGE_BYTES}\n")));
    if stage_weights() {
        assert!(!k.source.starts_with("#define MK_STAGE 0"));
        assert_eq!(k.shared_bytes(), 2 * STAGE_BYTES);
    }
    let off = Megakernel {
        program: k.program.clone(),
        schedule: k.schedule.clone(),
        // As the host emits it: without the preload, which spills beside it.
        source: format!("#define MK_STAGE 0\n#define MK_PRELOAD 0\n{}", k.source),
        staged: false,
    };
    assert_eq!(off.shared_bytes(), 0);
    let Some(include) = nvrtc_or_skip("no-staging compile") else {
        return;
    };
    let log = compile_without_spills(
        "megakernel_llama_tied_no_stage.cu".into(),
        off.source,
        &include,
    );
    assert!(!log.contains("mk_stage_tile"), "{log}");
}

/// The kernel's variants compile without spills at batch 1 and 8. The default source is the
/// attention-fused program with the argument preload (`MK_PRELOAD` defaults to 1) and without
/// split rows (the fixture's tiles have 8 rows, so none is small). Over it: split rows
/// (`#define MK_SPLIT 1`, what the host adds where a schedule has tiles of fewer rows than
/// warps), the input staging (`KILN_MK_XSTAGE=1`), both, the sequentially consistent signal
/// fence of runs 1–11 (`KILN_MK_SC_FENCE=1`) and no preload (`KILN_MK_PRELOAD=0`); and the
/// unfused program (`KILN_MK_FUSE_ATTN=0`) alone and with the input staging.
#[cfg(feature = "cuda")]
#[test]
fn megakernel_variants_compile_without_spills() {
    use kiln::backend::cuda::megakernel::generate_with;
    let vars = [
        "KILN_MK_SPLIT",
        "KILN_MK_PRELOAD",
        "KILN_MK_XSTAGE",
        "KILN_MK_FUSE_ATTN",
        "KILN_MK_SC_FENCE",
    ];
    if let Some(v) = vars.iter().find(|v| std::env::var_os(v).is_some()) {
        println!("SKIPPED: {v} is set");
        return;
    }
    let Some(include) = nvrtc_or_skip("megakernel variants compile") else {
        return;
    };
    for batch in [1usize, 8] {
        let k = generate(&plan("tests/fixtures/llama_tied"), batch).unwrap();
        assert!(!k.source.contains("#define MK_SPLIT 1"));
        assert!(!k.source.contains("#define MK_PRELOAD 0"));
        assert!(!k.source.contains("#define MK_XSTAGE 1"));
        for (name, defines) in [
            // Split rows come without the preload: together they spill (68 bytes at batch 1
            // under NVRTC 13.5), so the host leaves the preload out where it splits.
            ("split", "#define MK_SPLIT 1\n#define MK_PRELOAD 0\n"),
            ("xstage", "#define MK_XSTAGE 1\n"),
            (
                "split_xstage",
                "#define MK_SPLIT 1\n#define MK_PRELOAD 0\n#define MK_XSTAGE 1\n",
            ),
            ("scfence", "#define MK_SC_FENCE 1\n"),
            ("nopreload", "#define MK_PRELOAD 0\n"),
        ] {
            compile_without_spills(
                format!("megakernel_llama_tied_{name}_b{batch}.cu"),
                format!("{defines}{}", k.source),
                &include,
            );
        }
        // The unfused program has more instructions (a Rope and a KV append per layer).
        let unfused = generate_with(&plan("tests/fixtures/llama_tied"), batch, false).unwrap();
        assert!(unfused.program.instrs.len() > k.program.instrs.len());
        for (name, defines) in [("unfused", ""), ("unfused_xstage", "#define MK_XSTAGE 1\n")] {
            compile_without_spills(
                format!("megakernel_llama_tied_{name}_b{batch}.cu"),
                format!("{defines}{}", unfused.source),
                &include,
            );
        }
    }
}

/// Matvec tiles hold no more rows than the staging buffer takes: the Llama-3.2-1B shapes'
/// 2,048-column matrices 8 rows, its gated 2,048-column MLP 4, its 8,192-column down projection
/// 2; SmolLM2's 576 columns the full [`MATVEC_ROWS`].
#[test]
fn matvec_tiles_fit_the_staging_buffer() {
    let c = kiln::backend::cuda::megakernel::tile_config();
    if std::env::var_os("KILN_MK_MATVEC_ROWS").is_some() {
        println!("SKIPPED: KILN_MK_MATVEC_ROWS is set");
        return;
    }
    assert_eq!(c.stage_bytes, STAGE_BYTES);
    assert_eq!(c.rows_for(576, 1), MATVEC_ROWS);
    assert_eq!(c.rows_for(576, 2), MATVEC_ROWS);
    assert_eq!(c.rows_for(2048, 1), 8);
    assert_eq!(c.rows_for(2048, 2), 4);
    assert_eq!(c.rows_for(8192, 1), 2);
    assert_eq!(c.rows_for(1 << 20, 1), 1);
}

/// SmolLM2-135M's 30 layers (20,457 tiles at 8 rows per matvec tile) at batch 1 and 8, sm_90
/// and sm_80: no spills. The
/// kernel used to have one switch case per instruction with literal arguments and spilled about
/// 1.3 KB per thread; its arguments are now table rows and its switch has one case per tile kind.
/// Compiled with NVRTC only (tests/gpu.rs runs it on a GPU). Skipped (with a note) when the model
/// is absent.
#[cfg(feature = "cuda")]
#[test]
fn smollm2_megakernel_compiles_without_spills() {
    nvrtc_gate(true);
}

/// The host's mirror of the kernel's warps per block ([`MK_WARPS`], which decides where rows
/// split) is the header's `MK_THREADS / 32`.
#[test]
fn mk_warps_mirrors_the_header() {
    use kiln::backend::cuda::megakernel::MK_WARPS;
    let header = include_str!("../cuda/megakernel/tiles.cuh");
    let threads: usize = header
        .lines()
        .find_map(|l| l.strip_prefix("#define MK_THREADS "))
        .expect("MK_THREADS in tiles.cuh")
        .trim()
        .parse()
        .unwrap();
    assert_eq!(MK_WARPS, threads / 32);
}
