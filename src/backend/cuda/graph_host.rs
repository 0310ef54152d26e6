//! The host-side arithmetic of the graph-replayed decode megakernel ([`super::GraphDecoder`]):
//! batch buckets, the row table (positions, tokens and page tables per batch row; padding rows
//! and rows that left are inactive, position -1), the launch grid, the per-row sampling
//! controls and the ring of results with its epochs. Pure Rust (no feature, no GPU), so all of it is unit-tested here; the
//! CUDA side only moves the numbers this module computes.
//!
//! Ring protocol (contract of the generated kernel): the `e`-th launch since the counters were
//! zeroed is epoch `e` (the first is 1). It writes ring entry `e % RING`: words `[0, batch)` are
//! the sampled tokens (`NO_TOKEN` for an inactive row), word `batch` the bitmask of rows whose token is a stop id, word
//! `batch + 1` the epoch itself, written last. The host waits for entry `e % RING`'s epoch word
//! to equal `e`. Epochs are never reset while the counters live (a restart continues the
//! count), so a stale entry can never look fresh, and at most `RING - 1` launches are in flight,
//! so the device never overwrites an entry the host has not read.

use std::time::{Duration, Instant};

use kiln_codegen::MAX_BATCH;

use crate::backend::GraphRow;
use crate::sample::SamplingParams;

/// Ring entries (`MK_RING` in the generated kernel) and the stop ids the device checks
/// (`MK_MAX_STOP` in `cuda/sample.cuh`; further stop ids are checked on the host).
pub use kiln_codegen::{MkControl, MkRow, MAX_STOP, NO_TOKEN, RING};

/// Why the graph decoder refused or failed a request (the host-side part; driver failures are
/// [`super::CudaError::Driver`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    #[error("{rows} rows: the decode graph's batch buckets are 1, 2, 4 and 8")]
    NoBucket { rows: usize },
    #[error("{bucket} is not a decode graph bucket (1, 2, 4 or 8)")]
    BadBucket { bucket: usize },
    #[error("{rows} rows started on a decode graph of bucket {bucket}")]
    TooManyRows { rows: usize, bucket: usize },
    #[error("batch row {row} is not a row of a decode graph of bucket {bucket}")]
    RowOutOfBucket { row: usize, bucket: usize },
    #[error("batch row {row} is decoding a sequence already (it must leave first)")]
    RowOccupied { row: usize },
    #[error("batch row {row} is not decoding a sequence")]
    RowInactive { row: usize },
    #[error("row {row}: slot {slot} out of range (the cache has {slots} slots)")]
    SlotOutOfRange {
        row: usize,
        slot: usize,
        slots: usize,
    },
    #[error("row {row}: slot {slot} is already used by another row")]
    DuplicateSlot { row: usize, slot: usize },
    #[error("row {row}: position {pos} is past the {len} positions cached in slot {slot}")]
    PositionPastCache {
        row: usize,
        slot: usize,
        pos: usize,
        len: usize,
    },
    #[error("row {row}: position {pos} is not below the cache capacity {capacity}")]
    PositionPastCapacity {
        row: usize,
        pos: usize,
        capacity: usize,
    },
    #[error("row {row}: token {token} is outside the vocabulary ({vocab} tokens)")]
    TokenOutOfVocab {
        row: usize,
        token: u32,
        vocab: usize,
    },
    #[error("the device sampler does not apply a repetition penalty ({0}); use the host path")]
    RepetitionPenalty(f32),
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
    #[error("{0} row ids for at most {MAX_BATCH} rows")]
    TooManyRowIds(usize),
    #[error("the decode graph was started on a different KV cache than it was captured for")]
    OtherCache,
    #[error("the decode graph has not been started (or was stopped)")]
    NotStarted,
    #[error("{in_flight} decode steps in flight: the ring of {RING} entries holds at most {} unread", RING - 1)]
    RingFull { in_flight: usize },
    #[error("the next decode step would write position {pos}, past the cache capacity {capacity}")]
    CapacityReached { pos: usize, capacity: usize },
    #[error("no decode step in flight")]
    NothingInFlight,
    #[error(
        "decode step (epoch {epoch}) not done after {waited:?} (ring entry holds epoch {found})"
    )]
    Timeout {
        epoch: u32,
        found: u32,
        waited: Duration,
    },
    #[error("the stream finished but decode step (epoch {epoch})'s ring entry holds epoch {found}: the kernel did not publish its tokens")]
    NotPublished { epoch: u32, found: u32 },
    #[error(
        "the megakernel fits 0 blocks of {threads} threads per SM (registers or shared memory)"
    )]
    NoOccupancy { threads: usize },
}

pub use kiln_codegen::bucket_for;

/// Persistent blocks for the megakernel: every block must be resident at once (they wait on
/// each other's counters), so at most `sms × blocks_per_sm` (the occupancy API's answer for
/// 256 threads and no dynamic shared memory), and no more than there are tiles.
pub fn grid_blocks(
    sms: usize,
    blocks_per_sm: usize,
    tiles: usize,
    threads: usize,
) -> Result<usize, GraphError> {
    if blocks_per_sm == 0 {
        return Err(GraphError::NoOccupancy { threads });
    }
    Ok((sms.max(1) * blocks_per_sm).min(tiles).max(1))
}

/// Checks the started rows against the cache (`lens[slot]` positions cached, `capacity`) and the
/// vocabulary.
pub fn check_rows(
    rows: &[GraphRow],
    bucket: usize,
    lens: &[usize],
    capacity: usize,
    vocab: usize,
) -> Result<(), GraphError> {
    if rows.is_empty() || rows.len() > bucket {
        return Err(GraphError::TooManyRows {
            rows: rows.len(),
            bucket,
        });
    }
    for (row, r) in rows.iter().enumerate() {
        if r.slot >= lens.len() {
            return Err(GraphError::SlotOutOfRange {
                row,
                slot: r.slot,
                slots: lens.len(),
            });
        }
        if rows[..row].iter().any(|o| o.slot == r.slot) {
            return Err(GraphError::DuplicateSlot { row, slot: r.slot });
        }
        // The step attends to positions [0, pos]: everything before `pos` must be cached.
        if r.pos > lens[r.slot] {
            return Err(GraphError::PositionPastCache {
                row,
                slot: r.slot,
                pos: r.pos,
                len: lens[r.slot],
            });
        }
        if r.pos >= capacity {
            return Err(GraphError::PositionPastCapacity {
                row,
                pos: r.pos,
                capacity,
            });
        }
        if r.token as usize >= vocab {
            return Err(GraphError::TokenOutOfVocab {
                row,
                token: r.token,
                vocab,
            });
        }
    }
    Ok(())
}

/// The row table of a start of `rows` on a graph of `bucket` rows: positions, tokens and slots
/// per batch row, the started rows first; the rest of the bucket is inactive (position -1, token
/// 0, no slot), so it reads and writes nothing and needs no cache slot of its own.
pub fn batch_arrays(rows: &[GraphRow], bucket: usize) -> (Vec<i32>, Vec<i32>, Vec<Option<usize>>) {
    let n = bucket.max(rows.len());
    let mut pos = vec![-1; n];
    let mut tok = vec![0; n];
    let mut slot = vec![None; n];
    for (b, r) in rows.iter().enumerate() {
        pos[b] = r.pos as i32;
        tok[b] = r.token as i32;
        slot[b] = Some(r.slot);
    }
    (pos, tok, slot)
}

/// `MkControl` as the u32 words uploaded to the device (its size is a multiple of 8 bytes).
pub const CONTROL_WORDS: usize = MkControl::SIZE / 4;

/// One `MkRow` as u32 words.
pub const ROW_WORDS: usize = MkRow::SIZE / 4;

/// One batch row's controls for `params` (validated; a repetition penalty other than 1 is
/// refused: the device sampler does not apply one) and its Philox row.
pub fn row_control(params: &SamplingParams, row_id: u32) -> Result<MkRow, GraphError> {
    params
        .validate()
        .map_err(|e| GraphError::Sampling(e.to_string()))?;
    if let Some(p) = params.repetition_penalty.filter(|&p| p != 1.0) {
        return Err(GraphError::RepetitionPenalty(p));
    }
    MkRow::new(
        params.temperature,
        params.top_k,
        params.top_p,
        params.min_p,
        params.seed,
        row_id,
    )
    .map_err(|e| GraphError::Sampling(e.to_string()))
}

/// The control block for the batch rows' controls `rows` (the rest of the table greedy) and the
/// first [`MAX_STOP`] of `stops` (the host checks any others itself).
pub fn sampling_control(rows: &[MkRow], stops: &[u32]) -> Result<MkControl, GraphError> {
    if rows.len() > MAX_BATCH {
        return Err(GraphError::TooManyRowIds(rows.len()));
    }
    MkControl::new(rows, &stops[..stops.len().min(MAX_STOP)])
        .map_err(|e| GraphError::Sampling(e.to_string()))
}

/// One row's controls as u32 words (little-endian, the C layout), uploaded at word
/// `MkControl::row_offset(b) / 4` of the device block to change batch row `b` alone.
pub fn row_words(r: &MkRow) -> [u32; ROW_WORDS] {
    let bytes = r.as_bytes();
    let mut w = [0u32; ROW_WORDS];
    for (d, b) in w.iter_mut().zip(bytes.chunks_exact(4)) {
        *d = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    w
}

/// The control block's bytes as u32 words (little-endian, the C layout).
pub fn control_words(c: &MkControl) -> [u32; CONTROL_WORDS] {
    let bytes = c.as_bytes();
    let mut w = [0u32; CONTROL_WORDS];
    for (d, b) in w.iter_mut().zip(bytes.chunks_exact(4)) {
        *d = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    w
}

/// The bitmask of `tokens` (one per started row) that are in `stops[MAX_STOP..]`: the stop ids
/// the device does not check.
pub fn host_stop_mask(tokens: &[u32], stops: &[u32]) -> u32 {
    let extra = stops.get(MAX_STOP..).unwrap_or(&[]);
    tokens
        .iter()
        .enumerate()
        .filter(|(_, t)| extra.contains(t))
        .fold(0, |m, (b, _)| m | (1 << b))
}

/// The bits of the first `rows` batch rows (the started ones; padding rows follow).
pub fn row_mask(rows: usize) -> u32 {
    if rows >= 32 {
        u32::MAX
    } else {
        (1u32 << rows) - 1
    }
}

/// Epoch and ring bookkeeping of one graph decoder (see the module docs). `launched` is the
/// epoch of the last launch ever made and `consumed` the last one read or discarded; both are
/// u32 and wrap like the device's epoch counter.
#[derive(Clone, Debug)]
pub struct RingBook {
    batch: usize,
    launched: u32,
    consumed: u32,
    /// Whether launches are allowed (started and not stopped).
    started: bool,
    /// Per batch row, the position the next launch writes (`None`: inactive). Launches are
    /// stream-ordered, so a row changed between launches takes effect at the next one.
    next: Vec<Option<usize>>,
    capacity: usize,
}

impl RingBook {
    pub fn new(batch: usize) -> RingBook {
        RingBook {
            batch,
            launched: 0,
            consumed: 0,
            started: false,
            next: vec![None; batch],
            capacity: 0,
        }
    }

    /// u32 words per entry: the batch's tokens, the stop mask, the epoch.
    pub fn stride(&self) -> usize {
        self.batch + 2
    }

    /// u32 words of the whole ring.
    pub fn words(&self) -> usize {
        RING * self.stride()
    }

    fn entry(&self, epoch: u32) -> usize {
        (epoch as usize % RING) * self.stride()
    }

    /// Word of batch row `b`'s token in `epoch`'s entry.
    pub fn token_word(&self, epoch: u32, b: usize) -> usize {
        self.entry(epoch) + b
    }

    /// Word of `epoch`'s stop bitmask.
    pub fn mask_word(&self, epoch: u32) -> usize {
        self.entry(epoch) + self.batch
    }

    /// Word the kernel writes `epoch` into, last.
    pub fn epoch_word(&self, epoch: u32) -> usize {
        self.entry(epoch) + self.batch + 1
    }

    pub fn in_flight(&self) -> usize {
        self.launched.wrapping_sub(self.consumed) as usize
    }

    /// The device's epoch counter once everything launched has run.
    pub fn launched(&self) -> u32 {
        self.launched
    }

    pub fn started(&self) -> bool {
        self.started
    }

    /// A new start with each batch row's position (`None`: inactive) in a cache of `capacity`
    /// positions: forgets whatever was in flight (the caller has synchronised or discards it)
    /// and keeps the epoch count. Rows past `positions` are inactive.
    pub fn start(&mut self, positions: &[Option<usize>], capacity: usize) {
        self.consumed = self.launched;
        self.started = true;
        self.next = vec![None; self.batch];
        for (d, p) in self.next.iter_mut().zip(positions) {
            *d = *p;
        }
        self.capacity = capacity;
    }

    /// Batch row `b` joins at position `pos` (`Some`) or leaves (`None`) from the next launch
    /// on; the launches already booked keep their rows.
    pub fn set_row(&mut self, b: usize, pos: Option<usize>) -> Result<(), GraphError> {
        let slot = self.next.get_mut(b).ok_or(GraphError::RowOutOfBucket {
            row: b,
            bucket: self.batch,
        })?;
        *slot = pos;
        Ok(())
    }

    /// Each batch row's position at the next launch (`None`: inactive).
    pub fn positions(&self) -> &[Option<usize>] {
        &self.next
    }

    /// Books one launch; its epoch, or why it may not be launched.
    pub fn enqueue(&mut self) -> Result<u32, GraphError> {
        if !self.started {
            return Err(GraphError::NotStarted);
        }
        if self.in_flight() >= RING - 1 {
            return Err(GraphError::RingFull {
                in_flight: self.in_flight(),
            });
        }
        // Every active row writes its position: none may be at or past the capacity.
        if let Some(pos) = self.next.iter().flatten().copied().max() {
            if pos >= self.capacity {
                return Err(GraphError::CapacityReached {
                    pos,
                    capacity: self.capacity,
                });
            }
        }
        for p in self.next.iter_mut().flatten() {
            *p += 1;
        }
        self.launched = self.launched.wrapping_add(1);
        Ok(self.launched)
    }

    /// The epoch of the oldest launch not read yet.
    pub fn oldest(&self) -> Result<u32, GraphError> {
        if self.in_flight() == 0 {
            return Err(GraphError::NothingInFlight);
        }
        Ok(self.consumed.wrapping_add(1))
    }

    /// Marks the oldest launch read.
    pub fn consume(&mut self) {
        if self.in_flight() > 0 {
            self.consumed = self.consumed.wrapping_add(1);
        }
    }

    /// Forgets everything in flight and stops (the caller has synchronised the stream).
    pub fn stop(&mut self) {
        self.consumed = self.launched;
        self.started = false;
    }
}

/// What a poll of the stream found (`cuStreamQuery`).
#[derive(Clone, Debug, PartialEq)]
pub enum StreamState {
    /// Work still running.
    Busy,
    /// Everything enqueued has finished.
    Idle,
    /// The stream (or context) reported an error, e.g. a sticky launch failure.
    Failed(String),
}

/// Why [`wait_epoch`] gave up.
#[derive(Clone, Debug, PartialEq)]
pub enum WaitError {
    Graph(GraphError),
    Stream(String),
}

/// Spins until `read()` (a volatile read of the ring entry's epoch word) returns `epoch`.
/// Polls the stream every `poll` spins: a failed stream is reported at once, and an idle stream
/// whose entry still holds another epoch means the kernel never published it. Gives up after
/// `timeout` (a deadlock or a hung device) rather than hanging.
pub fn wait_epoch(
    epoch: u32,
    mut read: impl FnMut() -> u32,
    mut query: impl FnMut() -> StreamState,
    timeout: Duration,
    poll: u32,
) -> Result<(), WaitError> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if read() == epoch {
            return Ok(());
        }
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(poll.max(1)) {
            std::hint::spin_loop();
            continue;
        }
        match query() {
            StreamState::Busy => {}
            StreamState::Failed(e) => return Err(WaitError::Stream(e)),
            StreamState::Idle => {
                // The epoch word is written before the kernel exits; reread once after idle.
                let found = read();
                if found == epoch {
                    return Ok(());
                }
                return Err(WaitError::Graph(GraphError::NotPublished { epoch, found }));
            }
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(WaitError::Graph(GraphError::Timeout {
                epoch,
                found: read(),
                waited,
            }));
        }
        // Past the first millisecond a step is slow: stop burning a core at full speed.
        if waited > Duration::from_millis(1) {
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_up_to_eight() {
        let want = [1, 1, 2, 4, 4, 8, 8, 8, 8];
        for (rows, &b) in want.iter().enumerate() {
            assert_eq!(bucket_for(rows), Some(b), "{rows} rows");
        }
        assert_eq!(bucket_for(9), None);
        assert_eq!(bucket_for(1000), None);
    }

    #[test]
    fn grid_is_all_resident_blocks_capped_at_the_tiles() {
        assert_eq!(grid_blocks(132, 2, 5589, 256), Ok(264));
        assert_eq!(grid_blocks(132, 2, 100, 256), Ok(100));
        assert_eq!(grid_blocks(132, 1, 0, 256), Ok(1));
        assert_eq!(
            grid_blocks(132, 0, 100, 256),
            Err(GraphError::NoOccupancy { threads: 256 })
        );
    }

    fn row(slot: usize, pos: usize) -> GraphRow {
        GraphRow {
            slot,
            pos,
            token: 1,
            row_id: slot as u32,
        }
    }

    #[test]
    fn rows_past_the_started_ones_are_inactive_and_take_no_slot() {
        let rows = [row(0, 10), row(2, 12)];
        let (pos, tok, slot) = batch_arrays(&rows, 4);
        assert_eq!(pos, vec![10, 12, -1, -1]);
        assert_eq!(tok, vec![1, 1, 0, 0]);
        assert_eq!(slot, vec![Some(0), Some(2), None, None]);
        // A bucket of 8 on a cache of 3 slots: nothing to pad with is needed any more.
        assert_eq!(check_rows(&rows, 8, &[10, 0, 12], 16, 10), Ok(()));
    }

    #[test]
    fn rows_are_checked_against_the_cache() {
        let lens = [4, 0, 7, 0];
        assert_eq!(
            check_rows(&[row(0, 4), row(2, 3)], 2, &lens, 16, 10),
            Ok(())
        );
        let err = |rows: &[GraphRow], bucket| check_rows(rows, bucket, &lens, 16, 10).unwrap_err();
        assert_eq!(
            err(&[row(0, 4), row(0, 4)], 2),
            GraphError::DuplicateSlot { row: 1, slot: 0 }
        );
        assert_eq!(
            err(&[row(0, 5)], 1),
            GraphError::PositionPastCache {
                row: 0,
                slot: 0,
                pos: 5,
                len: 4
            }
        );
        assert_eq!(
            err(&[row(9, 0)], 1),
            GraphError::SlotOutOfRange {
                row: 0,
                slot: 9,
                slots: 4
            }
        );
        assert_eq!(
            err(&[row(0, 1), row(1, 0), row(2, 0)], 2),
            GraphError::TooManyRows { rows: 3, bucket: 2 }
        );
        assert_eq!(err(&[], 1), GraphError::TooManyRows { rows: 0, bucket: 1 });
        let mut r = row(0, 0);
        r.token = 10;
        assert_eq!(
            err(&[r], 1),
            GraphError::TokenOutOfVocab {
                row: 0,
                token: 10,
                vocab: 10
            }
        );
        let full = [16, 0];
        assert_eq!(
            check_rows(&[row(0, 16)], 1, &full, 16, 10),
            Err(GraphError::PositionPastCapacity {
                row: 0,
                pos: 16,
                capacity: 16
            })
        );
    }

    #[test]
    fn control_block_follows_the_c_layout() {
        // struct MkControl: 8 rows of 32 bytes (4 scalars, u64 seed at 16, row_id at 24, pad),
        // n_stop at 256, stop_ids at 260, 324 bytes padded to 328 (8-byte alignment).
        use std::mem::{offset_of, size_of};
        assert_eq!(offset_of!(MkRow, seed), 16);
        assert_eq!(offset_of!(MkRow, row_id), 24);
        assert_eq!(offset_of!(MkControl, n_stop), 256);
        assert_eq!(offset_of!(MkControl, stop_ids), 260);
        assert_eq!(size_of::<MkControl>(), 328);
        let p = SamplingParams {
            temperature: 0.7,
            top_k: Some(40),
            top_p: None,
            min_p: Some(0.05),
            repetition_penalty: None,
            seed: 0x1234_5678_9abc_def0,
        };
        let q = SamplingParams {
            temperature: 0.0,
            top_p: Some(0.5),
            seed: 7,
            ..p
        };
        let stops: Vec<u32> = (100..120).collect();
        let rows = [row_control(&p, 3).unwrap(), row_control(&q, 5).unwrap()];
        let c = sampling_control(&rows, &stops).unwrap();
        let w = control_words(&c);
        assert_eq!(w[0], 0.7f32.to_bits());
        assert_eq!(w[1], 40);
        assert_eq!(w[2], 1.0f32.to_bits(), "top-p off is 1");
        assert_eq!(w[3], 0.05f32.to_bits());
        assert_eq!((w[4], w[5]), (0x9abc_def0, 0x1234_5678));
        assert_eq!((w[6], w[7]), (3, 0));
        // Row 1: its own parameters, seed and Philox row.
        assert_eq!(w[8..16], row_words(&rows[1]));
        assert_eq!((w[8], w[10], w[12], w[14]), (0, 0.5f32.to_bits(), 7, 5));
        assert_eq!(
            MkControl::row_offset(1).unwrap() / 4,
            8,
            "a row's words start at its offset"
        );
        // Rows 2.. are greedy, top-p off.
        assert_eq!((w[16], w[18]), (0, 1.0f32.to_bits()));
        assert_eq!(w[64], MAX_STOP as u32);
        assert_eq!(w[65], 100);
        assert_eq!(w[80], 115);
        assert_eq!(w[81], 0, "padding");
        // Stops beyond the device's 16 are the host's.
        assert_eq!(host_stop_mask(&[116, 7, 119, 100], &stops), 0b101);
        assert_eq!(host_stop_mask(&[116], &stops[..16]), 0);
        assert_eq!(row_mask(3), 0b111);
        let bad = SamplingParams {
            repetition_penalty: Some(1.3),
            ..p
        };
        assert_eq!(
            row_control(&bad, 0),
            Err(GraphError::RepetitionPenalty(1.3))
        );
        let bad = SamplingParams {
            temperature: -1.0,
            ..p
        };
        assert!(matches!(row_control(&bad, 0), Err(GraphError::Sampling(_))));
        assert_eq!(
            sampling_control(&[rows[0]; 9], &[]),
            Err(GraphError::TooManyRowIds(9))
        );
    }

    /// A fake device: each launch writes its entry (tokens = epoch * 10 + row, epoch last).
    struct FakeDevice {
        ring: Vec<u32>,
        epoch: u32,
    }

    impl FakeDevice {
        fn run(&mut self, book: &RingBook, batch: usize) {
            self.epoch = self.epoch.wrapping_add(1);
            let e = self.epoch;
            for b in 0..batch {
                self.ring[book.token_word(e, b)] = e * 10 + b as u32;
            }
            self.ring[book.mask_word(e)] = e & 1;
            self.ring[book.epoch_word(e)] = e;
        }
    }

    #[test]
    fn ring_epochs_wrap_the_ring_and_stay_monotonic_across_restarts() {
        let batch = 2;
        let mut book = RingBook::new(batch);
        let mut dev = FakeDevice {
            ring: vec![0; book.words()],
            epoch: 0,
        };
        assert_eq!(book.enqueue(), Err(GraphError::NotStarted));
        book.start(&[Some(5)], 10_000);
        let mut seen = Vec::new();
        // Three times around the ring, with the in-flight depth varying.
        for round in 0..3 * RING / 4 {
            for _ in 0..(round % 5) + 1 {
                let e = book.enqueue().unwrap();
                assert_eq!(e, book.launched());
                dev.run(&book, batch);
            }
            while book.in_flight() > 1 {
                let e = book.oldest().unwrap();
                assert_eq!(dev.ring[book.epoch_word(e)], e);
                seen.push(dev.ring[book.token_word(e, 1)]);
                book.consume();
            }
        }
        let n = seen.len() as u32;
        assert_eq!(seen, (1..=n).map(|e| e * 10 + 1).collect::<Vec<_>>());
        // Stop with one step in flight, restart: the next epoch continues the count, and the
        // stale entry the new epoch maps to does not hold it.
        let before = book.launched();
        book.stop();
        assert_eq!(book.in_flight(), 0);
        assert_eq!(book.oldest(), Err(GraphError::NothingInFlight));
        assert_eq!(book.enqueue(), Err(GraphError::NotStarted));
        book.start(&[Some(7), Some(3)], 10_000);
        let e = book.enqueue().unwrap();
        assert_eq!(e, before + 1);
        assert_ne!(dev.ring[book.epoch_word(e)], e, "stale entry looks fresh");
    }

    #[test]
    fn at_most_ring_minus_one_in_flight_and_the_capacity_bounds_launches() {
        let mut book = RingBook::new(1);
        book.start(&[Some(0)], 10_000);
        for _ in 0..RING - 1 {
            book.enqueue().unwrap();
        }
        assert_eq!(
            book.enqueue(),
            Err(GraphError::RingFull {
                in_flight: RING - 1
            })
        );
        book.consume();
        book.enqueue().unwrap();
        // Positions 14 and 15 of a 16-position cache, then refuse.
        book.stop();
        book.start(&[Some(14)], 16);
        book.enqueue().unwrap();
        book.enqueue().unwrap();
        assert_eq!(
            book.enqueue(),
            Err(GraphError::CapacityReached {
                pos: 16,
                capacity: 16
            })
        );
    }

    #[test]
    fn rows_join_and_leave_between_launches_and_each_bounds_the_capacity() {
        let mut book = RingBook::new(4);
        book.start(&[Some(3)], 16);
        assert_eq!(book.positions(), [Some(3), None, None, None]);
        book.enqueue().unwrap();
        // Row 2 joins at 14: two launches left for it, while row 0 is far from the end.
        book.set_row(2, Some(14)).unwrap();
        book.enqueue().unwrap();
        book.enqueue().unwrap();
        assert_eq!(book.positions(), [Some(6), None, Some(16), None]);
        assert_eq!(
            book.enqueue(),
            Err(GraphError::CapacityReached {
                pos: 16,
                capacity: 16
            })
        );
        // It leaves: row 0 goes on; the launches in flight are untouched.
        book.set_row(2, None).unwrap();
        assert_eq!(book.in_flight(), 3);
        book.enqueue().unwrap();
        assert_eq!(book.positions(), [Some(7), None, None, None]);
        // Every row gone: launches are still allowed (they sample nothing).
        book.set_row(0, None).unwrap();
        book.enqueue().unwrap();
        assert_eq!(
            book.set_row(4, Some(0)),
            Err(GraphError::RowOutOfBucket { row: 4, bucket: 4 })
        );
    }

    #[test]
    fn epochs_wrap_around_u32() {
        let mut book = RingBook::new(1);
        book.launched = u32::MAX - 1;
        book.consumed = u32::MAX - 1;
        book.start(&[Some(0)], 100);
        let a = book.enqueue().unwrap();
        let b = book.enqueue().unwrap();
        assert_eq!((a, b), (u32::MAX, 0));
        assert_eq!(book.in_flight(), 2);
        assert_eq!(book.oldest(), Ok(u32::MAX));
        book.consume();
        assert_eq!(book.oldest(), Ok(0));
        assert_ne!(book.epoch_word(a), book.epoch_word(b));
    }

    #[test]
    fn waiting_reports_errors_instead_of_hanging() {
        let t = Duration::from_millis(50);
        // Published after a few reads.
        let mut n = 0;
        let r = wait_epoch(
            7,
            || {
                n += 1;
                if n > 5 {
                    7
                } else {
                    0
                }
            },
            || StreamState::Busy,
            t,
            2,
        );
        assert_eq!(r, Ok(()));
        // The stream went idle without the entry.
        assert_eq!(
            wait_epoch(7, || 3, || StreamState::Idle, t, 2),
            Err(WaitError::Graph(GraphError::NotPublished {
                epoch: 7,
                found: 3
            }))
        );
        // A sticky error.
        assert_eq!(
            wait_epoch(
                7,
                || 3,
                || StreamState::Failed("illegal address".into()),
                t,
                2
            ),
            Err(WaitError::Stream("illegal address".into()))
        );
        // A hung kernel.
        match wait_epoch(7, || 3, || StreamState::Busy, t, 2) {
            Err(WaitError::Graph(GraphError::Timeout {
                epoch: 7,
                found: 3,
                waited,
            })) => {
                assert!(waited >= t)
            }
            other => panic!("{other:?}"),
        }
    }
}
