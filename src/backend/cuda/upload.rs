//! Weight uploads through two pinned staging buffers: a matrix's bf16 values are written into
//! one page-locked buffer while the other's copy to the device runs, so the host touches no
//! fresh memory per tensor and the driver stages nothing.
//!
//! Why: on an H200 uploading the Llama-3.2-1B shape's 2.4 GB of bf16 matrices took 5.8 s
//! (`KILN_TRACE_CUDA=1`, docs/gpu-results.md run 10) when every matrix was first converted into a
//! new host vector and copied from pageable memory. Through this path (`KILN_TRACE_CUDA=1`,
//! docs/gpu-results.md): the same 65 matrices and 33 vectors in 356 ms on an H200 (run 11),
//! SmolLM2-135M's 121 matrices and 61 vectors in 85 ms on an H100 (run 12); every GPU test
//! uploads its weights through it.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};

use super::device::{drv, CudaError};
use crate::model::{DType, LoadError, Tensor, Weights};

/// Values (bf16) of one staging buffer: 32 MiB.
const CHUNK: usize = 16 << 20;

/// Two pinned buffers and the copy last issued from each.
pub(super) struct Staging {
    bufs: [PinnedHostSlice<u16>; 2],
    /// Recorded after the copy last issued from each buffer; waited on before it is refilled.
    pending: [Option<CudaEvent>; 2],
    next: usize,
}

/// Where a tensor's bf16 values come from: its stored bytes (little-endian bf16) or a converted
/// vector.
enum Values<'a> {
    Bytes(&'a [u8]),
    Converted(Vec<half::bf16>),
}

impl Staging {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Staging, CudaError> {
        // SAFETY: a buffer is written before any copy reads it (`put_bf16`).
        let alloc = || unsafe { ctx.alloc_pinned::<u16>(CHUNK) }.map_err(drv);
        Ok(Staging {
            bufs: [alloc()?, alloc()?],
            pending: [None, None],
            next: 0,
        })
    }

    /// Writes the first `n` values of `t`, as bf16 bits, into `dst[at..at + n]`: bf16 tensors
    /// byte for byte, every other format converted as `Tensor::to_bf16_vec` converts it. The
    /// copies run on `stream`; [`Staging::finish`] waits for them.
    pub fn put_bf16(
        &mut self,
        stream: &Arc<CudaStream>,
        weights: &Weights,
        t: &Tensor,
        n: usize,
        dst: &mut CudaSlice<u16>,
        at: usize,
    ) -> Result<(), CudaError> {
        let short = |have: usize| {
            CudaError::from(LoadError::tensor(
                &weights.source,
                &t.name,
                format!("{have} values where the device matrix takes {n}"),
            ))
        };
        let values = if t.dtype == DType::BF16 && cfg!(target_endian = "little") {
            let raw = t.raw();
            let bytes = n.checked_mul(2).ok_or_else(|| short(raw.len() / 2))?;
            Values::Bytes(raw.get(..bytes).ok_or_else(|| short(raw.len() / 2))?)
        } else {
            let v = t.to_bf16_vec();
            if v.len() < n {
                return Err(short(v.len()));
            }
            Values::Converted(v)
        };
        if at.checked_add(n).is_none_or(|end| end > dst.len()) {
            return Err(CudaError::Driver(format!(
                "{}: {n} values at {at} of a {}-value device matrix",
                t.name,
                dst.len()
            )));
        }
        let mut s = 0;
        while s < n {
            let len = CHUNK.min(n - s);
            let i = self.next;
            self.next ^= 1;
            if let Some(e) = self.pending[i].take() {
                e.synchronize().map_err(drv)?;
            }
            // Its own event is never recorded (copies read it as a plain slice): no wait here.
            let buf = &mut self.bufs[i].as_mut_slice().map_err(drv)?[..len];
            match &values {
                Values::Bytes(b) => bytemuck::cast_slice_mut::<u16, u8>(buf)
                    .copy_from_slice(&b[2 * s..2 * (s + len)]),
                Values::Converted(v) => {
                    for (d, x) in buf.iter_mut().zip(&v[s..s + len]) {
                        *d = x.to_bits();
                    }
                }
            }
            let mut view = dst.slice_mut(at + s..at + s + len);
            // A plain slice of pinned memory: the copy is asynchronous, so the event below
            // guards the buffer until it has been read.
            stream.memcpy_htod(&*buf, &mut view).map_err(drv)?;
            self.pending[i] = Some(stream.record_event(None).map_err(drv)?);
            s += len;
        }
        Ok(())
    }

    /// Waits for every copy issued.
    pub fn finish(&mut self) -> Result<(), CudaError> {
        for p in &mut self.pending {
            if let Some(e) = p.take() {
                e.synchronize().map_err(drv)?;
            }
        }
        Ok(())
    }
}

impl Drop for Staging {
    /// The buffers are freed only after the copies reading them (an error path may leave some).
    fn drop(&mut self) {
        for e in self.pending.iter_mut().filter_map(Option::take) {
            let _ = e.synchronize();
        }
    }
}
