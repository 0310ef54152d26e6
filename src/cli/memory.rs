//! How much memory a new allocation may take, so that a cache sized from a flag or a model file
//! is refused with a message instead of aborting the process when the allocation fails.
//!
//! Three limits apply on Linux, and the smallest wins: the kernel's estimate of memory
//! available without swapping (`MemAvailable` in `/proc/meminfo`), the room left under the
//! process's address-space limit (`ulimit -v`: `/proc/self/limits` minus `VmSize` in
//! `/proc/self/status`), and the room left in the process's cgroup v2 (`memory.max` minus
//! `memory.current`, the limit a container runs under). Where none can be read (not Linux),
//! [`available`] returns `None` and callers skip the check.

use std::fmt;
use std::path::Path;

/// Which limit bounds the memory available.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    MemAvailable,
    AddressSpace,
    Cgroup,
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Limit::MemAvailable => "MemAvailable in /proc/meminfo",
            Limit::AddressSpace => "room under the address-space limit, ulimit -v",
            Limit::Cgroup => "room under the cgroup's memory.max",
        })
    }
}

/// Bytes a new allocation may take, and which limit says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Available {
    pub bytes: u64,
    pub limit: Limit,
}

impl Available {
    /// The share of the memory available that one large allocation (a cache, a benchmark's
    /// buffers) may take: three quarters, the rest left to activations, the sampler and
    /// everything else running.
    pub fn usable(&self) -> u64 {
        self.bytes - self.bytes / 4
    }
}

/// The memory available now (see the module doc), `None` where no limit can be read.
pub fn available() -> Option<Available> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let mem = read("/proc/meminfo").and_then(|s| kib_field(&s, "MemAvailable:"));
    let address = match (
        read("/proc/self/limits").and_then(|s| address_space_limit(&s)),
        read("/proc/self/status").and_then(|s| kib_field(&s, "VmSize:")),
    ) {
        (Some(limit), Some(used)) => Some(limit.saturating_sub(used)),
        (Some(limit), None) => Some(limit),
        _ => None,
    };
    let cgroup =
        read("/proc/self/cgroup").and_then(|s| cgroup_room(&s, Path::new("/sys/fs/cgroup")));
    smallest(&[
        (mem, Limit::MemAvailable),
        (address, Limit::AddressSpace),
        (cgroup, Limit::Cgroup),
    ])
}

fn smallest(limits: &[(Option<u64>, Limit)]) -> Option<Available> {
    limits
        .iter()
        .filter_map(|&(bytes, limit)| bytes.map(|bytes| Available { bytes, limit }))
        .min_by_key(|a| a.bytes)
}

/// A `Key:   1234 kB` line of `/proc/meminfo` or `/proc/self/status`, in bytes.
fn kib_field(text: &str, key: &str) -> Option<u64> {
    let rest = text.lines().find_map(|l| l.strip_prefix(key))?;
    let mut words = rest.split_whitespace();
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        _ => None,
    }
}

/// The soft limit of `Max address space` in `/proc/self/limits`; `None` when unlimited.
fn address_space_limit(text: &str) -> Option<u64> {
    let rest = text
        .lines()
        .find_map(|l| l.strip_prefix("Max address space"))?;
    rest.split_whitespace().next()?.parse().ok()
}

/// `memory.max − memory.current` of the cgroup v2 that `/proc/self/cgroup` names (`0::/path`),
/// under `root` (`/sys/fs/cgroup`); `None` when the limit is `max` or unreadable.
fn cgroup_room(proc_cgroup: &str, root: &Path) -> Option<u64> {
    let path = proc_cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = root.join(path.trim_start_matches('/'));
    let read = |name: &str| -> Option<u64> {
        std::fs::read_to_string(dir.join(name))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let max = read("memory.max")?;
    Some(max.saturating_sub(read("memory.current").unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_proc_fields() {
        let meminfo =
            "MemTotal:       16384000 kB\nMemFree:         1000 kB\nMemAvailable:    2048 kB\n";
        assert_eq!(kib_field(meminfo, "MemAvailable:"), Some(2048 * 1024));
        assert_eq!(kib_field(meminfo, "Missing:"), None);
        assert_eq!(
            kib_field("VmSize: 18446744073709551615 kB\n", "VmSize:"),
            None
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max stack size            8388608              unlimited            bytes     \n\
                      Max address space         629145600            unlimited            bytes     \n";
        assert_eq!(address_space_limit(limits), Some(629_145_600));
        let unlimited = limits.replace("629145600   ", "unlimited   ");
        assert_eq!(address_space_limit(&unlimited), None);
    }

    #[test]
    fn the_smallest_limit_wins() {
        let a = smallest(&[
            (Some(8 << 30), Limit::MemAvailable),
            (Some(300 << 20), Limit::AddressSpace),
            (None, Limit::Cgroup),
        ]);
        assert_eq!(
            a,
            Some(Available {
                bytes: 300 << 20,
                limit: Limit::AddressSpace
            })
        );
        assert_eq!(smallest(&[(None, Limit::MemAvailable)]), None);
    }

    #[test]
    fn cgroup_room_is_max_minus_current() {
        let root = std::env::temp_dir().join(format!("kiln-cgroup-{}", std::process::id()));
        let dir = root.join("user.slice/job");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), "1000000\n").unwrap();
        std::fs::write(dir.join("memory.current"), "400000\n").unwrap();
        assert_eq!(cgroup_room("0::/user.slice/job\n", &root), Some(600_000));
        std::fs::write(dir.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_room("0::/user.slice/job\n", &root), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
