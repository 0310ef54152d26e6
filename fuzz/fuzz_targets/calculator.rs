//! `cargo +nightly fuzz run calculator` (from the repository root): the calculator tool must
//! never panic, whatever the model writes between `<|python_start|>` and `<|python_end|>`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kiln::engine::calculator::use_calculator(&String::from_utf8_lossy(data));
});
