//! `kiln-dump`'s output pinned by snapshots: every stage of four fixtures (HF llama, nanochat, nanochat era H,
//! a quantized GGUF) as canonical text. A compiler change that alters a graph, a pass or a plan
//! shows up here as a diff; when it is intended, regenerate with
//! `KILN_UPDATE_SNAPSHOTS=1 cargo test --release --test dump` and review the change.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::fixtures;
use kiln::dump::{concat, dump, DumpOptions, Format, Stage};
use kiln::model::Model;
use kiln::plan::Phase;

const FIXTURES: [(&str, &str); 4] = [
    ("llama_tied", "llama_tied"),
    ("nanochat", "nanochat"),
    ("llama_tied.q4_1.gguf", "llama_tied_q4_1"),
    ("nanochat_H", "nanochat_era_h"),
];

fn snapshots() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots")
}

fn render(model: &Model, stage: Stage, format: Format, phase: Phase) -> String {
    let opts = DumpOptions {
        stage,
        format,
        phase,
        ..DumpOptions::default()
    };
    concat(&dump(model, &opts).unwrap(), format)
}

/// Every stage with decode costs, then the prefill plan.
fn snapshot_text(model: &Model) -> String {
    render(model, Stage::All, Format::Text, Phase::Decode)
        + "\n"
        + &render(model, Stage::Plan, Format::Text, Phase::Prefill)
}

/// Fails naming the first line that differs, with both versions of it.
fn assert_matches_snapshot(name: &str, got: &str) {
    let path = snapshots().join(format!("{name}.txt"));
    if std::env::var_os("KILN_UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(snapshots()).unwrap();
        std::fs::write(&path, got).unwrap();
        eprintln!("updated {}", path.display());
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; create it with KILN_UPDATE_SNAPSHOTS=1",
            path.display()
        )
    });
    if want == got {
        return;
    }
    let (w, g): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    let line = (0..w.len().max(g.len()))
        .find(|&i| w.get(i) != g.get(i))
        .unwrap_or(w.len().min(g.len()));
    panic!(
        "{} differs from the dump at line {}:\n- snapshot: {}\n+ dump:     {}\n({} vs {} lines; if the change is intended, regenerate with KILN_UPDATE_SNAPSHOTS=1)",
        path.display(),
        line + 1,
        w.get(line).unwrap_or(&"<end of file>"),
        g.get(line).unwrap_or(&"<end of output>"),
        w.len(),
        g.len()
    );
}

#[test]
fn dumps_match_snapshots() {
    for (fixture, name) in FIXTURES {
        let model = Model::load(fixtures().join(fixture)).unwrap();
        assert_matches_snapshot(name, &snapshot_text(&model));
    }
}

#[test]
fn dumps_are_deterministic() {
    for (fixture, _) in FIXTURES {
        let a = Model::load(fixtures().join(fixture)).unwrap();
        let b = Model::load(fixtures().join(fixture)).unwrap();
        for format in [Format::Text, Format::Dot, Format::Json] {
            for phase in [Phase::Decode, Phase::Prefill] {
                assert_eq!(
                    render(&a, Stage::All, format, phase),
                    render(&b, Stage::All, format, phase),
                    "{fixture} {format:?} {phase:?}"
                );
            }
        }
    }
}

/// Braces outside quoted strings balance and never go negative.
fn braces_balance(dot: &str) -> bool {
    let (mut depth, mut quoted, mut escaped) = (0i64, false, false);
    for c in dot.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '{' if !quoted => depth += 1,
            '}' if !quoted => {
                depth -= 1;
                if depth < 0 {
                    return false;
                }
            }
            _ => {}
        }
    }
    depth == 0 && !quoted
}

#[test]
fn dot_and_json_are_well_formed() {
    let model = Model::load(fixtures().join("llama_tied")).unwrap();
    let files = dump(
        &model,
        &DumpOptions {
            format: Format::Dot,
            ..DumpOptions::default()
        },
    )
    .unwrap();
    // The graph before passes, one per pass, the plan.
    assert_eq!(
        files.len(),
        1 + kiln::graph::passes::default_pipeline().len() + 1
    );
    for f in &files {
        assert!(f.contents.starts_with("digraph"), "{}", f.file_name());
        assert!(braces_balance(&f.contents), "{}", f.file_name());
        assert!(f.contents.contains(" -> "), "{}", f.file_name());
    }
    let files = dump(
        &model,
        &DumpOptions {
            format: Format::Json,
            ..DumpOptions::default()
        },
    )
    .unwrap();
    for f in &files {
        let v: serde_json::Value = serde_json::from_str(&f.contents).unwrap();
        assert!(
            v["total"]["bytes"].as_u64().unwrap() > 0,
            "{}",
            f.file_name()
        );
    }
    let all: serde_json::Value = serde_json::from_str(&concat(&files, Format::Json)).unwrap();
    assert_eq!(all.as_array().unwrap().len(), files.len());
}

#[test]
fn cli_writes_one_file_per_stage() {
    let dir = std::env::temp_dir().join(format!("kiln-dump-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let model = fixtures().join("llama_tied");
    let out = Command::new(env!("CARGO_BIN_EXE_kiln-dump"))
        .args(["-m", model.to_str().unwrap(), "-o", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "00-graph.txt",
            "01-after-narrow-to-last-rows.txt",
            "02-after-fuse-norm-into-matmul.txt",
            "03-after-merge-sibling-matmuls.txt",
            "04-after-fuse-gated-activation.txt",
            "05-after-fuse-activation.txt",
            "06-after-fuse-residual-add.txt",
            "megakernel-program.txt",
            "megakernel.cu",
            "plan-decode.txt",
        ]
    );
    // The files hold what stdout would.
    let model = Model::load(fixtures().join("llama_tied")).unwrap();
    let files = dump(&model, &DumpOptions::default()).unwrap();
    for f in files {
        assert_eq!(
            std::fs::read_to_string(dir.join(f.file_name())).unwrap(),
            f.contents
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
