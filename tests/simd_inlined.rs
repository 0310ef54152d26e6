//! Every SIMD intrinsic in the release binaries is inlined into its kernel. An intrinsic left
//! out of line (a `core::core_arch::x86::<isa>::_mm…` function in the symbol table) means some
//! kernel calls a function per vector instruction: a closure (`array::from_fn(|i| …)`) or a helper
//! compiled without the caller's `#[target_feature]`s, which LLVM inlined or not depending on
//! how the code was split into codegen units. It happened twice in this project, each time
//! halving a kernel's speed with no test noticing (the last: batched decode of 12–16 sequences
//! on AVX-512 fell from ~600 to ~340 tok/s when a reduction moved modules). Reads the symbols
//! with `nm`; skips in debug builds (nothing is inlined there) and where `nm` is absent.

use std::process::Command;

#[test]
fn no_simd_intrinsic_is_left_out_of_line() {
    if cfg!(debug_assertions) {
        eprintln!("SKIPPED: a debug build inlines nothing (run with --release)");
        return;
    }
    for bin in [env!("CARGO_BIN_EXE_kiln"), env!("CARGO_BIN_EXE_kiln-bench")] {
        let out = match Command::new("nm").arg("-C").arg(bin).output() {
            Ok(o) if o.status.success() => o,
            _ => {
                eprintln!("SKIPPED: `nm` is not available to read {bin}'s symbols");
                return;
            }
        };
        let symbols = String::from_utf8_lossy(&out.stdout);
        let outlined: Vec<&str> = symbols
            .lines()
            .filter_map(|l| l.split_whitespace().nth(2).map(|_| l))
            .filter(|l| {
                let name = l.splitn(3, ' ').nth(2).unwrap_or("");
                name.starts_with("core::core_arch::x86")
                    && name.contains("::_mm")
                    && !name.contains("::xsave::")
            })
            .collect();
        assert!(
            outlined.is_empty(),
            "{bin}: SIMD intrinsics compiled out of line:\n{}",
            outlined.join("\n")
        );
    }
}
