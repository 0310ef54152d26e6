//! How many of a few 512-bit instructions one core retires a second, each in twelve independent
//! chains (so their latency does not bound them) with no memory operands: the peaks that the
//! README compares kiln's CPU kernels against (the f32 FMA that the exact panels issue, the
//! `vpdpbusd` of the int8 and int16 kernels, the `vdpbf16ps` of `--numerics bf16` and of
//! llama.cpp's bf16 products, the `vpermps` lookups of the exact grouped kernels).
//!
//! ```text
//! cargo run --release --example instruction_rates [-- SECONDS]
//! ```
//!
//! Run it on a quiet machine; each figure is the best of three runs of about `SECONDS / 15`
//! (default 3 s in all). x86-64 CPUs with AVX-512 only; an instruction the CPU lacks is
//! reported as such.

#[cfg(target_arch = "x86_64")]
mod rates {
    use std::time::Instant;

    /// Runs of the loop body (twelve instructions) per timed call.
    const LOOPS: u64 = 10_000_000;

    /// A function issuing `$op zmm{i}, zmm20, zmm21` for each of twelve chains `i` per loop,
    /// compiled with `$feat`.
    macro_rules! rate_of {
        ($op:literal, $feat:literal) => {
            rate_of!(@ $op, $feat, 0 1 2 3 4 5 6 7 8 9 10 11)
        };
        (@ $op:literal, $feat:literal, $($chain:literal)*) => {{
            #[target_feature(enable = $feat)]
            unsafe fn run(loops: u64) {
                // SAFETY (of the asm): registers only; every vector register it writes is a
                // caller-saved one, which `clobber_abi` declares.
                unsafe {
                    core::arch::asm!(
                        "vpxord zmm20, zmm20, zmm20",
                        "vpxord zmm21, zmm21, zmm21",
                        "2:",
                        $(concat!($op, " zmm", $chain, ", zmm20, zmm21"),)*
                        "dec rcx",
                        "jnz 2b",
                        inout("rcx") loops => _,
                        clobber_abi("C"),
                        options(nostack, nomem),
                    );
                }
            }
            run as unsafe fn(u64)
        }};
    }

    /// One instruction to time: its mnemonic, what one does, whether this CPU has it, and the
    /// timed loop.
    type Case = (&'static str, &'static str, bool, unsafe fn(u64));

    /// Instructions a second of `run`, best of three, over about `seconds`.
    fn measure(run: unsafe fn(u64), seconds: f64) -> f64 {
        // SAFETY: the caller checked the CPU's features for `run`.
        let timed = |loops: u64| {
            let t = Instant::now();
            unsafe { run(loops) };
            t.elapsed().as_secs_f64()
        };
        let once = timed(LOOPS);
        let loops = ((seconds / 3.0 / once.max(1e-6)) * LOOPS as f64).max(1.0) as u64;
        (0..3)
            .map(|_| 12.0 * loops as f64 / timed(loops))
            .fold(0.0, f64::max)
    }

    pub fn main() {
        let seconds: f64 = match std::env::args().nth(1) {
            Some(s) => match s.parse() {
                Ok(v) if v > 0.0 => v,
                _ => {
                    eprintln!("instruction_rates: '{s}' is not a positive number of seconds");
                    std::process::exit(2);
                }
            },
            None => 3.0,
        };
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("instruction_rates: this CPU has no AVX-512");
            std::process::exit(1);
        }
        let each = seconds / 5.0;
        let cases: [Case; 5] = [
            (
                "vfmadd231ps",
                "16 f32 multiply-adds",
                true,
                rate_of!("vfmadd231ps", "avx512f"),
            ),
            (
                "vpdpbusd",
                "64 u8 x s8 products",
                is_x86_feature_detected!("avx512vnni"),
                rate_of!("vpdpbusd", "avx512f,avx512vnni"),
            ),
            (
                "vdpbf16ps",
                "32 bf16 products",
                is_x86_feature_detected!("avx512bf16"),
                rate_of!("vdpbf16ps", "avx512f,avx512bf16"),
            ),
            (
                "vpermps",
                "a 16-lane lookup",
                true,
                rate_of!("vpermps", "avx512f"),
            ),
            ("vpaddd", "16 i32 adds", true, rate_of!("vpaddd", "avx512f")),
        ];
        println!("| zmm instruction | each does | G/s, one core |");
        println!("|---|---|---:|");
        for (name, does, present, run) in cases {
            if present {
                println!("| {name} | {does} | {:.2} |", measure(run, each) / 1e9);
            } else {
                println!("| {name} | {does} | (not on this CPU) |");
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn main() {
    rates::main()
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("instruction_rates: x86-64 only");
    std::process::exit(1);
}
