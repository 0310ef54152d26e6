//! `cargo +nightly fuzz run serve_args` (from `fuzz/`): libFuzzer's bytes as a `kiln serve`
//! command line — split on NUL into arguments, each kept as raw bytes (non-UTF-8 included),
//! after `kiln serve` — parsed and checked by `kiln::cli::serve_args::parse_serve_args` as the
//! binary does before it loads a model. Any outcome is fine but a panic, which is a crash.
#![no_main]

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let argv = std::iter::once(OsString::from("kiln serve")).chain(
        data.split(|&b| b == 0)
            .map(|a| OsString::from_vec(a.to_vec())),
    );
    let _ = kiln::cli::serve_args::parse_serve_args(argv);
});
