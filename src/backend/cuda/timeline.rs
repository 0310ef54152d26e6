//! `KILN_MK_TIMELINE=DIR`: the decode megakernel compiled with `MK_TIMELINE 1`
//! (`cuda/megakernel/tiles.cuh`) records, for every tile of a step, when its block reached it,
//! when its dependency wait ended and when its work ended (the GPU's global timer, ns), and the
//! SM and block that ran it. After each [`super::GraphDecoder::stop`] the records of the last
//! step replayed are written to `DIR/mk-timeline-b{bucket}.csv`, one line per tile with what it
//! is (instruction, rows, the counters it waits on), so that where a step's time goes — waiting
//! on which producers, or working — can be read off one step instead of guessed from sampled
//! stalls. A diagnostic: it adds timer reads and stores to every tile and changes the kernel's
//! source (its own cache entry).
//!
//! Ran on an H200 (docs/gpu-results.md, run 11): SmolLM2-135M and Llama-3.2-1B-shape steps
//! recorded at batch 1 and 8 and read with `scripts/mk_timeline.py`; the recording made a
//! SmolLM2 batch-1 step about 6% longer (1,288 µs against 1,214 µs untimed).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaModule, CudaStream};
use kiln_codegen::{DecodeProgram, Schedule};

use super::device::{drv, CudaError};

/// What a compiled module needs to write its timeline: the module (whose `mk_timeline` global
/// holds the records), the directory, and each tile's description.
pub(super) struct Timeline {
    module: Arc<CudaModule>,
    dir: PathBuf,
    tiles: Vec<String>,
}

impl Timeline {
    pub(super) fn new(
        module: Arc<CudaModule>,
        dir: PathBuf,
        p: &DecodeProgram,
        s: &Schedule,
    ) -> Self {
        Timeline {
            module,
            dir,
            tiles: describe_tiles(p, s),
        }
    }

    /// Copies the records of the last step replayed (the stream must be idle) and writes
    /// `mk-timeline-b{bucket}.csv`; returns its path.
    pub(super) fn write(
        &self,
        stream: &Arc<CudaStream>,
        bucket: usize,
    ) -> Result<PathBuf, CudaError> {
        let global = self
            .module
            .get_global("mk_timeline", stream)
            .map_err(|e| CudaError::Driver(format!("the megakernel's mk_timeline: {e:?}")))?;
        let bytes: Vec<u8> = stream.clone_dtoh(&global).map_err(drv)?;
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|w| u64::from_ne_bytes(w.try_into().unwrap_or([0; 8])))
            .collect();
        let csv = timeline_csv(&self.tiles, &words).map_err(CudaError::Driver)?;
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| CudaError::Driver(format!("creating {}: {e}", self.dir.display())))?;
        let path = self.dir.join(format!("mk-timeline-b{bucket}.csv"));
        std::fs::write(&path, &csv)
            .map_err(|e| CudaError::Driver(format!("writing {}: {e}", path.display())))?;
        Ok(path)
    }
}

/// The CSV header: the tile's description, then its record (ns from the step's first record).
pub const HEADER: &str =
    "tile,instr,name,segment,lo,hi,waits,block,sm,reached_ns,waited_ns,done_ns";

/// Per tile: `tile,instr,name,segment,lo,hi,waits`, the waits as `i{instr}` (an instruction's
/// counter) or `t{tile}` (one tile's) joined by `;`.
pub fn describe_tiles(p: &DecodeProgram, s: &Schedule) -> Vec<String> {
    let instrs = p.instrs.len();
    s.tiles
        .iter()
        .enumerate()
        .map(|(t, tile)| {
            let mut line = format!(
                "{t},{},{},{},{},{},",
                tile.instr,
                p.instrs[tile.instr].name(),
                tile.segment,
                tile.lo,
                tile.hi
            );
            for (i, w) in tile.waits.iter().enumerate() {
                if i > 0 {
                    line.push(';');
                }
                let _ = match w.counter.checked_sub(instrs) {
                    None => write!(line, "i{}", w.counter),
                    Some(tile) => write!(line, "t{tile}"),
                };
            }
            line
        })
        .collect()
}

/// The CSV of one step: `tiles` (from [`describe_tiles`]) beside the four words the kernel
/// wrote per tile, times relative to the earliest `reached`.
pub fn timeline_csv(tiles: &[String], words: &[u64]) -> Result<String, String> {
    if words.len() != 4 * tiles.len() {
        return Err(format!(
            "mk_timeline holds {} words, {} tiles need {}",
            words.len(),
            tiles.len(),
            4 * tiles.len()
        ));
    }
    let t0 = words.chunks_exact(4).map(|r| r[0]).min().unwrap_or(0);
    let mut out = String::with_capacity(tiles.len() * 64);
    out.push_str(HEADER);
    out.push('\n');
    for (desc, r) in tiles.iter().zip(words.chunks_exact(4)) {
        let rel = |v: u64| v.wrapping_sub(t0) as i64;
        let _ = writeln!(
            out,
            "{desc},{},{},{},{},{}",
            r[3] & 0xffff_ffff,
            r[3] >> 32,
            rel(r[0]),
            rel(r[1]),
            rel(r[2])
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_lines_carry_the_description_then_block_sm_and_relative_times() {
        let tiles = vec![
            "0,0,embed,0,0,1,".to_string(),
            "1,1,rms_norm,0,0,1,i0".to_string(),
        ];
        let words = [
            1_000,
            1_010,
            1_500,
            (3 << 32) | 7, //
            1_200,
            1_600,
            1_900,
            (5 << 32) | 8,
        ];
        let csv = timeline_csv(&tiles, &words).unwrap();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0], HEADER);
        assert_eq!(lines[1], "0,0,embed,0,0,1,,7,3,0,10,500");
        assert_eq!(lines[2], "1,1,rms_norm,0,0,1,i0,8,5,200,600,900");
        assert_eq!(lines[0].split(',').count(), lines[2].split(',').count());
        assert!(timeline_csv(&tiles, &words[..4]).is_err());
    }
}
