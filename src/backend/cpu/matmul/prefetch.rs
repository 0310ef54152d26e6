//! Where the streaming kernels ask for weights ahead of their loads, chosen once per process by
//! CPU vendor, since the two vendors measured want opposite things.
//!
//! A decode step reads every weight once from DRAM; how much of the memory's bandwidth a core
//! gets depends on how many lines it has in flight.
//!
//! - **Intel** (a 2-vCPU Xeon with AVX-512 and AMX, family 6 model 167, 2026-12-04): software
//!   prefetches into L2 (`prefetcht1`) beat prefetches into L1 (`prefetcht0`), which hold one of
//!   the few L1 fill buffers each until the line lands, and the one-row dense GEMV wants a
//!   prefetch of its row stream well ahead. `kiln-bench -t 2 -p 0 -n 128 -r 3`, variants
//!   alternating twice, tokens/s: SmolLM2-135M BF16 76–80 without prefetch, 91–92 with
//!   `prefetcht0` 2 KiB ahead, 108–120 with `prefetcht1` 4–32 KiB ahead (8 KiB: 113–119);
//!   the grouped kernels' one-group-ahead prefetch into L2 instead of L1: Q8_0 156–179 →
//!   200–228, Qwen2.5-Coder-0.5B Q4_K_M 46.2–46.5 → 51.3–54.0, Q4_1 within the host's spread
//!   (251–301 either way); without any prefetch the grouped Q4_1 kernel ran 155–162. The AVX2
//!   one-row GEMV (`KILN_SIMD=avx2`) with its stream 8 KiB ahead into L2 instead of 2 KiB into
//!   L1: BF16 95.7–96.5 → 103.7–107.7; its int8 kernels' next-group prefetches into L2
//!   (`--numerics int8`): Q8_0 184.6–187.1 → 221.1–224.5, Q4_1 377.5–397.0 either way.
//! - **AMD Zen 5** (family 26, a 2-vCPU AMD EPYC with AVX-512, 2026-12-07): the one-row dense
//!   GEMV wants Intel's row prefetch, 8 KiB ahead into L2, and the grouped kernels their L1
//!   prefetch. SmolLM2 decode, one process alternating policies, 128 steps a round, median
//!   per-round time ratio: BF16 1.35× faster with the row prefetch (`l2` against `l1`, 40
//!   rounds; 2 KiB ahead gained less, 4–32 KiB the same within the spread), while the grouped
//!   kernels' prefetches into L2 made Q8_0 5% slower (0.95, 40 rounds) and moved Q4_1 and
//!   Qwen2.5-Coder-0.5B Q4_K_M by less than their spread. So Zen 5 takes `rows`: each the
//!   better half. (The AVX2 one-row GEMV, `KILN_SIMD=avx2`, which with a row prefetch asks
//!   8 KiB ahead into L2 rather than 2 KiB into L1, decoded BF16 the same either way:
//!   `kiln-bench -t 2 -p 0 -n 128 -r 3`, alternating three times, 136.8–145.6 tok/s under `l1`
//!   against 134.4–152.8 under `rows`.)
//! - **Others** (measured on an AMD Zen 4, 2026-12-03): one row read as one stream without
//!   software prefetch was fastest for bf16 weights (a C model of the GEMV: 27–31 GB/s against
//!   21–26 with prefetches 512–2048 B ahead into L1; the row prefetch into L2 that Zen 5 takes
//!   was not tried there), and the grouped kernels keep their L1 prefetch, which that session's
//!   distance trials did not move beyond noise.
//!
//! `KILN_PREFETCH=l1`, `l2` or `rows` sets the policy for a process (`l1`: the last above, `l2`:
//! Intel's, `rows`: Zen 5's), for measuring one against another on the CPU in hand. Prefetches
//! change no result: the kernels' sums are the same bits under every policy.

use std::sync::OnceLock;

/// How far ahead the one-row dense GEMV (f32/bf16 weights) prefetches its row stream under the
/// L2 policy: the middle of the 4–32 KiB plateau measured on the Intel Xeon above.
pub(crate) const ROW_AHEAD_L2: usize = 8 << 10;

/// The process's prefetch policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Policy {
    /// Whether the grouped and int8 kernels' next-group prefetches go into L2 (else L1).
    pub(crate) to_l2: bool,
    /// How many bytes ahead of its loads the one-row dense GEMVs and the AVX-512 one-row tiles
    /// of few-token calls prefetch, into L2; 0: each kernel's L1 choice (AVX-512: none; the
    /// AVX2 GEMV: 2 KiB ahead into L1, its best on a Zen 3).
    pub(crate) row_ahead: usize,
}

impl Policy {
    const L1: Policy = Policy {
        to_l2: false,
        row_ahead: 0,
    };
    const L2: Policy = Policy {
        to_l2: true,
        row_ahead: ROW_AHEAD_L2,
    };
    const ROWS: Policy = Policy {
        to_l2: false,
        row_ahead: ROW_AHEAD_L2,
    };
    /// Every policy, as `KILN_PREFETCH` names them.
    const ALL: [Policy; 3] = [Policy::L1, Policy::L2, Policy::ROWS];

    /// The policy `KILN_PREFETCH` names (`l1`, `l2` or `rows`, any case), if it names one.
    fn parse(s: &str) -> Option<Policy> {
        let s = s.trim().to_ascii_lowercase();
        Policy::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The policy's name, as `KILN_PREFETCH` spells it.
    pub(crate) fn name(self) -> &'static str {
        match (self.to_l2, self.row_ahead != 0) {
            (true, _) => "l2",
            (false, true) => "rows",
            (false, false) => "l1",
        }
    }
}

/// The policy of this process: `KILN_PREFETCH` where it names one, else by CPU vendor and
/// family.
pub(crate) fn policy() -> Policy {
    static POLICY: OnceLock<Policy> = OnceLock::new();
    *POLICY.get_or_init(|| {
        std::env::var("KILN_PREFETCH")
            .ok()
            .and_then(|s| Policy::parse(&s))
            .unwrap_or_else(|| {
                if intel() {
                    Policy::L2
                } else if amd_family() >= ZEN5_FAMILY {
                    Policy::ROWS
                } else {
                    Policy::L1
                }
            })
    })
}

/// The CPU's vendor string and, where it has leaf 1, CPUID leaf 1's EAX (family, model and
/// stepping), asked once (a `cpuid` exits to a hypervisor).
#[cfg(target_arch = "x86_64")]
fn identity() -> ([u8; 12], Option<u32>) {
    static IDENTITY: OnceLock<([u8; 12], Option<u32>)> = OnceLock::new();
    *IDENTITY.get_or_init(|| {
        use std::arch::x86_64::__cpuid;
        // CPUID leaf 0 (the vendor string and the highest leaf) exists on every x86_64 CPU.
        let r = __cpuid(0);
        let mut vendor = [0u8; 12];
        vendor[0..4].copy_from_slice(&r.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
        vendor[8..12].copy_from_slice(&r.ecx.to_le_bytes());
        (vendor, (r.eax >= 1).then(|| __cpuid(1).eax))
    })
}

/// Whether the CPU's vendor string is Intel's.
#[cfg(target_arch = "x86_64")]
pub(crate) fn intel() -> bool {
    &identity().0 == b"GenuineIntel"
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn intel() -> bool {
    false
}

/// AMD's family number of Zen 5 (0x1A).
const ZEN5_FAMILY: u32 = 0x1A;

/// The CPU's family number (base plus extended, as AMD numbers them) when its vendor string is
/// AMD's, else 0.
#[cfg(target_arch = "x86_64")]
fn amd_family() -> u32 {
    match identity() {
        (vendor, Some(eax)) if &vendor == b"AuthenticAMD" => family(eax),
        _ => 0,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn amd_family() -> u32 {
    0
}

/// The family number in CPUID leaf 1's EAX: the base family, plus the extended family where
/// the base is 0xF.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn family(eax: u32) -> u32 {
    let base = (eax >> 8) & 0xF;
    if base == 0xF {
        base + ((eax >> 20) & 0xFF)
    } else {
        base
    }
}

/// Evaluates `$e` with `$l2` a `const bool`: the process's [`policy`]'s hint (`true`: into L2),
/// for kernels that take the hint as a constant parameter (see [`lines_at_step`]).
macro_rules! with_hint {
    ($l2:ident => $e:expr) => {
        if $crate::backend::cpu::matmul::prefetch::policy().to_l2 {
            const $l2: bool = true;
            $e
        } else {
            const $l2: bool = false;
            $e
        }
    };
}
pub(crate) use with_hint;

/// Step `i` of `steps` of asking for the `lines` lines from `next`, into L2 (`L2`) or L1: the
/// lines `l` with `⌊steps·l / lines⌋ = i`, so that a kernel taking a step between its loads
/// spreads the requests over them instead of issuing them in one burst, which waits on the line
/// fill buffers ahead of the loads behind it. `next` is always an address to ask for (a pass
/// with nothing new to fetch passes its own block, which is in cache), and the hint a constant:
/// with `lines` and `steps` constants too, a step is its prefetch instructions and nothing
/// else. Testing for null and for the hint at every step had put two branches beside each
/// prefetch of the block's body, and the AVX-512 kernels lost to them: one core of the 2-vCPU
/// Intel Xeon (family 6 model 167), `cargo bench --bench kernels -- 'gemv/(Q4_1|Q8_0)-grouped/
/// 1536x576/avx512'`, builds alternating, Q4_1 16.8–16.9 → 18.2–18.6 GiB/s, Q8_0 26.8–27.7 →
/// 27.9–28.4.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn lines_at_step<const L2: bool>(
    next: *const u8,
    lines: usize,
    (i, steps): (usize, usize),
) {
    for l in (i * lines).div_ceil(steps)..((i + 1) * lines).div_ceil(steps) {
        line_to::<L2>(next.wrapping_add(64 * l));
    }
}

/// [`line`] with the hint a constant.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn line_to<const L2: bool>(p: *const u8) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    // SAFETY: a prefetch never faults, whatever the address.
    unsafe {
        if L2 {
            _mm_prefetch::<_MM_HINT_T1>(p as *const i8)
        } else {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
        }
    }
}

/// Asks for the line at `p` into L2 (`to_l2`) or L1; never faults, whatever the address.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn line(p: *const u8, to_l2: bool) {
    if to_l2 {
        line_to::<true>(p)
    } else {
        line_to::<false>(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPUID leaf 1's EAX of CPUs seen here: Zen 3 and Zen 4 are family 0x19, Zen 5 0x1A; an
    /// Intel Xeon's base family 6 has no extended part.
    #[test]
    fn families_read_as_amd_numbers_them() {
        assert_eq!(family(0x00A0_0F11), 0x19); // Zen 3 (family 25 model 1)
        assert_eq!(family(0x00A1_0F11), 0x19); // Zen 4 (family 25 model 17)
        assert_eq!(family(0x00B0_0F21), 0x1A); // Zen 5 (family 26 model 2)
        assert_eq!(family(0x000C_06F1), 6); // Intel family 6 model 207
    }

    #[test]
    fn the_variable_names_every_policy() {
        assert_eq!(Policy::parse("l1"), Some(Policy::L1));
        assert_eq!(Policy::parse(" L2 "), Some(Policy::L2));
        assert_eq!(Policy::parse("l3"), None);
        assert_eq!(Policy::parse(""), None);
        assert_eq!(Policy::L1.name(), "l1");
        assert_eq!(Policy::L2.name(), "l2");
        assert_eq!(Policy::parse("Rows"), Some(Policy::ROWS));
        assert_eq!(Policy::ROWS.name(), "rows");
        assert_eq!(Policy::L1.row_ahead, 0);
        assert_eq!(Policy::L2.row_ahead, ROW_AHEAD_L2);
        assert_eq!(Policy::ROWS.row_ahead, ROW_AHEAD_L2);
    }
}
