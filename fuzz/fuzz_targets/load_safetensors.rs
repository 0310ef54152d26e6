//! `cargo +nightly fuzz run load_safetensors` (from `fuzz/`): the structure-aware mutator of
//! `tests/fuzz/mod.rs` driven by libFuzzer's bytes (they seed the mutation choices), so
//! coverage guidance steers which edits of the fixtures are tried. A panic is a crash.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/fuzz/mod.rs"]
mod fuzz;

fuzz_target!(|data: &[u8]| {
    let seeds = SEEDS.get_or_init(fuzz::Seeds::load);
    let dir = std::env::temp_dir().join(format!("kiln-cargo-fuzz-{}-safetensors", std::process::id()));
    let case = fuzz::generate(fuzz::Format::Safetensors, seeds, &mut fuzz::Rng::from_bytes(data));
    let path = case.write(&dir).expect("write the case");
    let _ = fuzz::exercise(&path, fuzz::Format::Safetensors);
});

static SEEDS: std::sync::OnceLock<fuzz::Seeds> = std::sync::OnceLock::new();
