//! Where a roofline's bandwidth comes from. A decode step is memory-bound, so `kiln-bench`
//! scores it as (bytes the step must move / bandwidth) over the measured time; the bandwidth is
//! measured on the machine the step ran on, or given on the command line:
//!
//! * [`BandwidthSource::CpuRead`]: the fastest of two streaming reads
//!   ([`crate::backend::cpu::stream`]) over a buffer as large as the data the step reads, once
//!   per thread count and size. The size matters: a CPU whose last-level cache holds a small
//!   model's weights reads them from there, and a 1 GiB read scored such a step against DRAM
//!   (the 2-vCPU Intel Xeon of 2026-12-06, family 6 model 167, 480 MiB of L3: the 1 GiB read
//!   used before gave 23.5 GB/s and the demo Q4_1 decode "130% of the roofline"; a read of its
//!   step's 97 MiB gives 52.6).
//! * [`BandwidthSource::DeviceCopy`]: a device-to-device copy on GPU 0, counting bytes read plus
//!   bytes written, the usual way to state a copy's bandwidth (PyTorch's `copy_` measured the
//!   same way is the cross-check in `scripts/torch_compare.py --measure-bandwidth`).
//! * [`BandwidthSource::Given`]: `--bandwidth-gbs`, e.g. a copy measured by another tool.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

use crate::backend::cpu::stream;

#[derive(Debug, thiserror::Error)]
pub enum BandwidthError {
    #[error("allocating {mib} MiB to measure bandwidth failed (try a smaller --bandwidth-mib)")]
    Alloc { mib: usize },
    #[error("a thread pool of {threads} threads: {reason}")]
    Threads { threads: usize, reason: String },
    #[error("measuring GPU bandwidth: {0}")]
    Device(String),
    #[error("this build has no CUDA support (build with `--features cuda`)")]
    NoCuda,
}

/// A bandwidth and what measured it, for the report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Bandwidth {
    pub bytes_per_s: f64,
    pub source: String,
}

/// The largest buffer a CPU read takes when sized by the step: far above any last-level cache,
/// so a larger step reads DRAM as this does.
pub const MAX_STEP_READ_MIB: usize = 1024;

pub enum BandwidthSource {
    /// Bytes/s given by the user.
    Given(f64),
    /// CPU streaming read of `mib` MiB where given, else of the step's bytes
    /// ([`step_read_mib`]), measured once per thread count and size.
    CpuRead {
        mib: Option<usize>,
        measured: BTreeMap<(usize, usize), CpuRead>,
    },
    /// Device-to-device copy of `mib` MiB on GPU 0, measured once.
    DeviceCopy {
        mib: usize,
        measured: Option<DeviceCopy>,
    },
}

impl BandwidthSource {
    /// A CPU read of `mib` MiB, or (`None`) of each step's bytes.
    pub fn cpu_read(mib: Option<usize>) -> BandwidthSource {
        BandwidthSource::CpuRead {
            mib,
            measured: BTreeMap::new(),
        }
    }

    pub fn device_copy(mib: usize) -> BandwidthSource {
        BandwidthSource::DeviceCopy {
            mib,
            measured: None,
        }
    }

    /// The bandwidth for a step of `threads` CPU threads that reads `step_bytes` (both ignored
    /// by the device and given sources), measuring it on first use and logging the measurement
    /// to stderr.
    pub fn get(&mut self, threads: usize, step_bytes: u64) -> Result<Bandwidth, BandwidthError> {
        match self {
            BandwidthSource::Given(bw) => Ok(Bandwidth {
                bytes_per_s: *bw,
                source: format!("given: {:.1} GB/s", *bw / 1e9),
            }),
            BandwidthSource::CpuRead { mib, measured } => {
                let (size, sized_by) = match *mib {
                    Some(m) => (m.max(1), "--bandwidth-mib"),
                    None => (step_read_mib(step_bytes), "the step's bytes"),
                };
                let read = match measured.get(&(threads, size)) {
                    Some(r) => *r,
                    None => {
                        let r = cpu_read(threads, size)?;
                        crate::note!(
                            "kiln-bench: memory bandwidth {:.1} GB/s (streaming read of {size} MiB, {sized_by}, {threads} threads, median of 5; {}; {:.1} GB/s {})",
                            r.bytes_per_s / 1e9,
                            r.how(),
                            r.other_bytes_per_s / 1e9,
                            if r.prefetch { "without" } else { "with L2 requests" },
                        );
                        measured.insert((threads, size), r);
                        r
                    }
                };
                Ok(Bandwidth {
                    bytes_per_s: read.bytes_per_s,
                    source: format!(
                        "CPU streaming read of {size} MiB ({sized_by}), {threads} threads, {}",
                        read.how()
                    ),
                })
            }
            BandwidthSource::DeviceCopy { mib, measured } => {
                let copy = match measured {
                    Some(c) => c.clone(),
                    None => {
                        let c = device_copy(*mib, 20)?;
                        crate::note!("kiln-bench: {}", c.summary());
                        *measured = Some(c.clone());
                        c
                    }
                };
                Ok(Bandwidth {
                    bytes_per_s: copy.bytes_per_s,
                    source: format!("device-to-device copy on {}", copy.device),
                })
            }
        }
    }
}

/// The buffer a CPU read of a step of `step_bytes` takes, in MiB: the step's bytes rounded up
/// to a whole MiB, at most [`MAX_STEP_READ_MIB`]. Not rounded further: a buffer larger than the
/// step straddles the last-level cache where the step does not (the BF16 demo model's 261 MiB
/// read as 384 MiB on the Intel Xeon above, whose L3 holds part of either, measured 29.6 GB/s
/// where the step itself read 32.3).
pub fn step_read_mib(step_bytes: u64) -> usize {
    let mib = step_bytes.div_ceil(1 << 20).max(1);
    mib.min(MAX_STEP_READ_MIB as u64) as usize
}

/// One CPU read measurement: the faster of the two reads, and the other's figure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuRead {
    pub bytes_per_s: f64,
    /// Whether the faster read asked for its lines into L2 ahead ([`stream::sum`]).
    pub prefetch: bool,
    /// The other read's bytes/s.
    pub other_bytes_per_s: f64,
}

impl CpuRead {
    fn how(&self) -> &'static str {
        if self.prefetch {
            "lines asked into L2 ahead"
        } else {
            "hardware prefetch alone"
        }
    }
}

/// Streaming-read bandwidth with `threads` threads over a buffer of `mib` MiB: after one pass of
/// each read that faults the pages in (and fills the caches as a step's previous step would),
/// five passes of each, alternating, each thread reading 1 MiB chunks with [`stream::sum`];
/// the median of each read, and the faster of the two.
pub fn cpu_read(threads: usize, mib: usize) -> Result<CpuRead, BandwidthError> {
    use rayon::prelude::*;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| BandwidthError::Threads {
            threads,
            reason: e.to_string(),
        })?;
    let floats = mib
        .max(1)
        .checked_mul(1 << 18)
        .ok_or(BandwidthError::Alloc { mib })?;
    let mut buf: Vec<f32> = Vec::new();
    buf.try_reserve_exact(floats)
        .map_err(|_| BandwidthError::Alloc { mib })?;
    // Chunks of 1 MiB: small enough to balance across threads, large enough to stream.
    let chunk = 1 << 18;
    pool.install(|| {
        buf.resize(floats, 0.0);
        buf.par_chunks_mut(chunk).enumerate().for_each(|(i, c)| {
            c.iter_mut()
                .enumerate()
                .for_each(|(j, w)| *w = ((i + j) % 7) as f32)
        });
    });
    let pass = |prefetch: bool| {
        let t0 = Instant::now();
        let sum: f32 = pool.install(|| {
            buf.par_chunks(chunk)
                .map(|c| stream::sum(c, prefetch))
                .sum()
        });
        std::hint::black_box(sum);
        t0.elapsed().as_secs_f64()
    };
    pass(false);
    pass(true);
    let (mut plain, mut ahead) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        plain.push(pass(false));
        ahead.push(pass(true));
    }
    let rate = |mut secs: Vec<f64>| {
        secs.sort_by(f64::total_cmp);
        (floats * 4) as f64 / super::median(&secs)
    };
    let (plain, ahead) = (rate(plain), rate(ahead));
    Ok(CpuRead {
        bytes_per_s: plain.max(ahead),
        prefetch: ahead > plain,
        other_bytes_per_s: plain.min(ahead),
    })
}

/// One device-to-device copy measurement.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceCopy {
    /// The GPU, as [`crate::backend::cuda::DeviceInfo`] prints it.
    pub device: String,
    /// Bytes of the buffer copied.
    pub buffer_bytes: u64,
    /// Bytes moved per copy: read plus written.
    pub bytes_moved: u64,
    /// Event-timed milliseconds of each copy, in order.
    pub samples_ms: Vec<f64>,
    pub median_ms: f64,
    /// `bytes_moved / median`.
    pub bytes_per_s: f64,
}

impl DeviceCopy {
    pub fn summary(&self) -> String {
        format!(
            "device bandwidth {:.1} GB/s ({} MiB device-to-device copy, read + write, median of {} event-timed copies, {})",
            self.bytes_per_s / 1e9,
            self.buffer_bytes >> 20,
            self.samples_ms.len(),
            self.device
        )
    }
}

/// Copies a `mib` MiB buffer of non-zero bytes to another on GPU 0: 3 warm-up copies, then
/// `reps` copies each timed by CUDA events on the stream; checks every byte of the destination
/// afterwards. On an H200 (docs/gpu-results.md): 4,195 to 4,211 GB/s over several runs, against
/// 4,148 to 4,199 GB/s for torch's `copy_` in the same runs.
#[cfg(feature = "cuda")]
pub fn device_copy(mib: usize, reps: usize) -> Result<DeviceCopy, BandwidthError> {
    use cudarc::driver::sys::CUevent_flags;
    let err =
        |what: &str, e: &dyn std::fmt::Debug| BandwidthError::Device(format!("{what}: {e:?}"));
    let (ctx, info) =
        crate::backend::cuda::probe().map_err(|e| BandwidthError::Device(e.to_string()))?;
    let stream = ctx.default_stream();
    let n = mib.max(1) << 20;
    let mut host: Vec<u8> = Vec::new();
    host.try_reserve_exact(n)
        .map_err(|_| BandwidthError::Alloc { mib })?;
    // Never zeros (a copy engine or cache may treat them specially); a period prime to 2^k.
    host.extend((0..n).map(|i| (i % 251) as u8 | 1));
    let src = stream
        .clone_htod(&host)
        .map_err(|e| err("uploading the source", &e))?;
    let mut dst = stream
        .alloc_zeros::<u8>(n)
        .map_err(|e| err("allocating the destination", &e))?;
    let event = || {
        ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| err("creating an event", &e))
    };
    let (start, end) = (event()?, event()?);
    for _ in 0..3 {
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| err("copying", &e))?;
    }
    let mut samples_ms = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        start.record(&stream).map_err(|e| err("recording", &e))?;
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| err("copying", &e))?;
        end.record(&stream).map_err(|e| err("recording", &e))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| err("reading events", &e))?;
        samples_ms.push(ms as f64);
    }
    let back = stream
        .clone_dtoh(&dst)
        .map_err(|e| err("downloading the copy", &e))?;
    if let Some(i) = back.iter().zip(&host).position(|(a, b)| a != b) {
        return Err(BandwidthError::Device(format!(
            "the copy is wrong at byte {i} of {n}: {} instead of {}",
            back[i], host[i]
        )));
    }
    let mut sorted = samples_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let median_ms = super::median(&sorted);
    let bytes_moved = 2 * n as u64;
    Ok(DeviceCopy {
        device: info.to_string(),
        buffer_bytes: n as u64,
        bytes_moved,
        samples_ms,
        median_ms,
        bytes_per_s: bytes_moved as f64 / (median_ms / 1e3),
    })
}

#[cfg(not(feature = "cuda"))]
pub fn device_copy(_mib: usize, _reps: usize) -> Result<DeviceCopy, BandwidthError> {
    Err(BandwidthError::NoCuda)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_bandwidth_is_reported_as_given() {
        let mut s = BandwidthSource::Given(3.0e12);
        let b = s.get(4, 1 << 30).unwrap();
        assert_eq!(b.bytes_per_s, 3.0e12);
        assert_eq!(b.source, "given: 3000.0 GB/s");
    }

    #[test]
    fn cpu_read_is_measured_once_per_thread_count_and_size() {
        let mut s = BandwidthSource::cpu_read(None);
        let a = s.get(1, (5 << 20) - 1).unwrap();
        assert!(a.bytes_per_s > 1e8, "{a:?}");
        assert!(
            a.source
                .starts_with("CPU streaming read of 5 MiB (the step's bytes), 1 threads, "),
            "{}",
            a.source
        );
        // A step of the same whole MiB shares the measurement; a larger one does not.
        assert_eq!(s.get(1, 5 << 20).unwrap(), a);
        s.get(1, (5 << 20) + 1).unwrap();
        match &s {
            BandwidthSource::CpuRead { measured, .. } => {
                assert_eq!(
                    measured.keys().copied().collect::<Vec<_>>(),
                    vec![(1, 5), (1, 6)]
                )
            }
            _ => unreachable!(),
        }
        let mut given = BandwidthSource::cpu_read(Some(2));
        let b = given.get(1, 1 << 30).unwrap();
        assert!(b
            .source
            .starts_with("CPU streaming read of 2 MiB (--bandwidth-mib), 1 threads, "));
    }

    #[test]
    fn a_step_reads_its_bytes_in_whole_mib_up_to_a_gib() {
        assert_eq!(step_read_mib(0), 1);
        assert_eq!(step_read_mib(1), 1);
        assert_eq!(step_read_mib(1 << 20), 1);
        assert_eq!(step_read_mib((1 << 20) + 1), 2);
        assert_eq!(step_read_mib(101_200_000), 97);
        assert_eq!(step_read_mib(5000 << 20), MAX_STEP_READ_MIB);
        assert_eq!(step_read_mib(u64::MAX), MAX_STEP_READ_MIB);
    }
}
