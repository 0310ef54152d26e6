//! Transparent huge pages for the large buffers every step sweeps: the weights (once per token)
//! and the KV cache (once per attention call). With 4 KiB pages such a sweep misses the TLB on
//! every page; a 2 MiB page covers 512 of them. Linux backs a range with huge pages at its first
//! touch when the range was advised (`MADV_HUGEPAGE`) before it, in the `madvise` and `always`
//! modes of `/sys/kernel/mm/transparent_hugepage/enabled`. Advice only: elsewhere, or where the
//! kernel declines, the memory is ordinary memory and only the speed differs.

/// A huge page: 2 MiB on x86-64 and the usual arm64 configuration.
pub const HUGE_PAGE: usize = 2 << 20;

/// Advises the whole huge pages inside `len` bytes at `ptr` (this process's own memory, not
/// yet touched where it should get them); a range holding none is left alone.
pub fn advise(ptr: *const u8, len: usize) {
    if let Some((start, len)) = whole_pages(ptr as usize, len) {
        advise_range(start, len);
    }
}

/// The whole huge pages of the `len` bytes at address `at`: their start and length, if any.
fn whole_pages(at: usize, len: usize) -> Option<(usize, usize)> {
    let start = at.checked_next_multiple_of(HUGE_PAGE)?;
    let end = at.checked_add(len)? / HUGE_PAGE * HUGE_PAGE;
    (end > start).then(|| (start, end - start))
}

#[cfg(target_os = "linux")]
fn advise_range(start: usize, len: usize) {
    // SAFETY: the range lies in memory this process allocated (the caller's); the advice
    // changes how it is backed, never its contents.
    unsafe {
        libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_range(_start: usize, _len: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only whole, aligned huge pages are advised: none in a range shorter than one or
    /// straddling a boundary without covering a page, the interior of an unaligned range.
    #[test]
    fn whole_pages_inside_a_range() {
        const H: usize = HUGE_PAGE;
        assert_eq!(whole_pages(4 * H, 3 * H), Some((4 * H, 3 * H)));
        assert_eq!(whole_pages(4 * H + 5, 3 * H), Some((5 * H, 2 * H)));
        assert_eq!(whole_pages(4 * H - 5, H + 10), Some((4 * H, H)));
        assert_eq!(whole_pages(4 * H + 5, H), None);
        assert_eq!(whole_pages(4 * H, H - 1), None);
        assert_eq!(whole_pages(4 * H, 0), None);
        assert_eq!(whole_pages(usize::MAX - 5, 3), None);
        assert_eq!(whole_pages(H, usize::MAX), None);
    }

    /// Advice leaves the contents alone.
    #[test]
    fn advice_keeps_contents() {
        let mut v = vec![7u8; 3 * HUGE_PAGE];
        advise(v.as_ptr(), v.len());
        v[2 * HUGE_PAGE] = 9;
        assert!(v
            .iter()
            .enumerate()
            .all(|(i, &b)| b == if i == 2 * HUGE_PAGE { 9 } else { 7 }));
    }
}
