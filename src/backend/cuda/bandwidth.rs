//! The device's memory bandwidth as kiln-bench's roofline uses it: a large device-to-device
//! copy, timed with events, bytes read plus bytes written over the median time (the method of
//! the device README's METHOD.md). UNVERIFIED on a GPU (written on machines without one).

use cudarc::driver::sys::CUevent_flags;

use super::device::{probe, CudaError};

fn drv<E: std::fmt::Debug>(e: E) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

/// Copies `mib` MiB device to device `reps` times (after one warm-up) and returns the median
/// bandwidth in bytes/s, counting each copy's bytes twice (read and written).
pub fn measure_copy_bandwidth(mib: usize, reps: usize) -> Result<f64, CudaError> {
    let (ctx, _) = probe()?;
    let stream = ctx.default_stream();
    let n = (mib.max(1) << 20) / 4;
    // Random-looking data: zeros can move faster than real data on some parts.
    let host: Vec<u32> = (0..n as u32)
        .map(|i| i.wrapping_mul(0x9E37_79B9) ^ 0x5bd1_e995)
        .collect();
    let src = stream.clone_htod(&host).map_err(drv)?;
    let mut dst = stream.alloc_zeros::<u32>(n).map_err(drv)?;
    let mut times = Vec::with_capacity(reps);
    for rep in 0..=reps.max(1) {
        let start = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)?;
        stream.memcpy_dtod(&src, &mut dst).map_err(drv)?;
        let end = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)?;
        end.synchronize().map_err(drv)?;
        let ms = start.elapsed_ms(&end).map_err(drv)?;
        if rep > 0 {
            times.push(ms as f64);
        }
    }
    times.sort_by(f64::total_cmp);
    let median_ms = times[times.len() / 2];
    Ok(2.0 * (n * 4) as f64 / (median_ms / 1e3))
}
