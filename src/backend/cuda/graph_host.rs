//! The host-side arithmetic of the graph-replayed decode megakernel ([`super::GraphDecoder`]):
//! batch buckets, padding rows, the launch grid, the sampling control block and the ring of
//! results with its epochs. Pure Rust (no feature, no GPU), so all of it is unit-tested here; the
//! CUDA side only moves the numbers this module computes.
//!
//! Ring protocol (contract of the generated kernel): the `e`-th launch since the counters were
//! zeroed is epoch `e` (the first is 1). It writes ring entry `e % RING`: words `[0, batch)` are
//! the sampled tokens, word `batch` the bitmask of rows whose token is a stop id, word
//! `batch + 1` the epoch itself, written last. The host waits for entry `e % RING`'s epoch word
//! to equal `e`. Epochs are never reset while the counters live (a restart continues the
//! count), so a stale entry can never look fresh, and at most `RING - 1` launches are in flight,
//! so the device never overwrites an entry the host has not read.

use std::time::{Duration, Instant};

use kiln_codegen::MAX_BATCH;

use crate::sample::SamplingParams;

/// Ring entries (`MK_RING` in the generated kernel) and the stop ids the device checks
/// (`MK_MAX_STOP` in `cuda/sample.cuh`; further stop ids are checked on the host).
pub use kiln_codegen::{MkControl, MAX_STOP, RING};

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
    #[error("a decode graph of bucket {bucket} needs a cache of at least {bucket} slots (padding rows), this one has {slots}")]
    TooFewSlots { bucket: usize, slots: usize },
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

/// One row to decode: the token it embeds at position `pos` of cache slot `slot`, and the
/// engine row keying its Philox draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphRow {
    pub slot: usize,
    pub pos: usize,
    pub token: u32,
    pub row_id: u32,
}

/// A filler row of a bucket larger than the rows started: a slot no started row uses, and the
/// position its first step writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PadRow {
    pub slot: usize,
    pub pos: usize,
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
    if lens.len() < bucket {
        return Err(GraphError::TooFewSlots {
            bucket,
            slots: lens.len(),
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

/// The filler rows of a bucket: `bucket - rows.len()` slots no started row uses, those with the
/// fewest cached positions first (spare slots, then finished rows), each at position
/// `min(len, lowest started position)`.
///
/// Why that position: a padding row writes K/V (and nanochat's smear state) at its position and
/// advances one per step like every row, and nothing on the device checks the capacity. Starting
/// at or below the lowest started position keeps it in bounds for as long as the started rows
/// are (the host stops enqueuing before any started row would pass the capacity); starting at or
/// above the slot's cached length leaves everything the slot holds intact. When a slot's cached
/// length exceeds the lowest started position (only possible for a slot holding a longer,
/// finished sequence), positions from there on are overwritten: the graph never changes cache
/// lengths, so such a slot must not be read again without being refilled. Slot lengths alone
/// cannot tell a finished row from a paused one: callers pad only with slots they no longer read.
pub fn padding_rows(
    rows: &[GraphRow],
    bucket: usize,
    lens: &[usize],
) -> Result<Vec<PadRow>, GraphError> {
    let need = bucket.saturating_sub(rows.len());
    let lowest = rows.iter().map(|r| r.pos).min().unwrap_or(0);
    let mut free: Vec<usize> = (0..lens.len())
        .filter(|s| rows.iter().all(|r| r.slot != *s))
        .collect();
    if free.len() < need {
        return Err(GraphError::TooFewSlots {
            bucket,
            slots: lens.len(),
        });
    }
    free.sort_by_key(|&s| (lens[s], s));
    Ok(free[..need]
        .iter()
        .map(|&slot| PadRow {
            slot,
            pos: lens[slot].min(lowest),
        })
        .collect())
}

/// The per-batch-row device arrays of a start: positions, tokens, slots (started rows, then
/// padding rows with token 0).
pub fn batch_arrays(rows: &[GraphRow], pads: &[PadRow]) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let mut pos = Vec::with_capacity(rows.len() + pads.len());
    let mut tok = Vec::with_capacity(rows.len() + pads.len());
    let mut slot = Vec::with_capacity(rows.len() + pads.len());
    for r in rows {
        pos.push(r.pos as i32);
        tok.push(r.token as i32);
        slot.push(r.slot as i32);
    }
    for p in pads {
        pos.push(p.pos as i32);
        tok.push(0);
        slot.push(p.slot as i32);
    }
    (pos, tok, slot)
}

/// `MkControl` as the u32 words uploaded to the device (its size is a multiple of 8 bytes).
pub const CONTROL_WORDS: usize = MkControl::SIZE / 4;

/// The control block for `params` (validated; a repetition penalty other than 1 is refused:
/// the device sampler does not apply one), `row_ids` for the batch rows (padding rows get 0)
/// and the first [`MAX_STOP`] of `stops` (the host checks any others itself).
pub fn sampling_control(
    params: &SamplingParams,
    row_ids: &[u32],
    stops: &[u32],
) -> Result<MkControl, GraphError> {
    params
        .validate()
        .map_err(|e| GraphError::Sampling(e.to_string()))?;
    if let Some(p) = params.repetition_penalty.filter(|&p| p != 1.0) {
        return Err(GraphError::RepetitionPenalty(p));
    }
    if row_ids.len() > MAX_BATCH {
        return Err(GraphError::TooManyRowIds(row_ids.len()));
    }
    MkControl::new(
        params.temperature,
        params.top_k,
        params.top_p,
        params.min_p,
        params.seed,
        row_ids,
        &stops[..stops.len().min(MAX_STOP)],
    )
    .map_err(|e| GraphError::Sampling(e.to_string()))
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
    /// Launches the cache capacity still allows since the last start; `None` when stopped.
    steps_left: Option<usize>,
    /// The position the next launch's rows write at, for the capacity error.
    next_pos: usize,
    capacity: usize,
}

impl RingBook {
    pub fn new(batch: usize) -> RingBook {
        RingBook {
            batch,
            launched: 0,
            consumed: 0,
            steps_left: None,
            next_pos: 0,
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
        self.steps_left.is_some()
    }

    /// A new start whose highest row position is `max_pos` in a cache of `capacity` positions:
    /// forgets whatever was in flight (the caller has synchronised or discards it) and keeps the
    /// epoch count.
    pub fn start(&mut self, max_pos: usize, capacity: usize) {
        self.consumed = self.launched;
        self.steps_left = Some(capacity.saturating_sub(max_pos));
        self.next_pos = max_pos;
        self.capacity = capacity;
    }

    /// Books one launch; its epoch, or why it may not be launched.
    pub fn enqueue(&mut self) -> Result<u32, GraphError> {
        let left = self.steps_left.ok_or(GraphError::NotStarted)?;
        if self.in_flight() >= RING - 1 {
            return Err(GraphError::RingFull {
                in_flight: self.in_flight(),
            });
        }
        if left == 0 {
            return Err(GraphError::CapacityReached {
                pos: self.next_pos,
                capacity: self.capacity,
            });
        }
        self.steps_left = Some(left - 1);
        self.next_pos += 1;
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
        self.steps_left = None;
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
    fn padding_prefers_empty_slots_and_never_outruns_the_started_rows() {
        // Slots 0 and 2 started at 10 and 12; 1 holds 30 positions, 3 holds 5, 4 and 5 none.
        let lens = [10, 30, 12, 5, 0, 0];
        let rows = [row(0, 10), row(2, 12)];
        let pads = padding_rows(&rows, 4, &lens).unwrap();
        assert_eq!(
            pads,
            vec![PadRow { slot: 4, pos: 0 }, PadRow { slot: 5, pos: 0 }]
        );
        // Without spare slots: slot 3 (5 cached) keeps its positions, then slot 1 is cut at the
        // lowest started position (10).
        let lens = [10, 30, 12, 5];
        let pads = padding_rows(&rows, 4, &lens).unwrap();
        assert_eq!(
            pads,
            vec![PadRow { slot: 3, pos: 5 }, PadRow { slot: 1, pos: 10 }]
        );
        for p in &pads {
            assert!(p.pos <= 10, "a padding row ahead of every started row");
        }
        assert_eq!(padding_rows(&rows, 2, &lens).unwrap(), vec![]);
        assert_eq!(
            padding_rows(&rows, 8, &lens),
            Err(GraphError::TooFewSlots {
                bucket: 8,
                slots: 4
            })
        );
        let (pos, tok, slot) = batch_arrays(&rows, &pads);
        assert_eq!(pos, vec![10, 12, 5, 10]);
        assert_eq!(tok, vec![1, 1, 0, 0]);
        assert_eq!(slot, vec![0, 2, 3, 1]);
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
        // struct MkControl: 4 scalars, u64 seed at byte 16, row_ids at 24, n_stop at 56,
        // stop_ids at 60, 124 bytes padded to 128 (8-byte alignment).
        use std::mem::{offset_of, size_of};
        assert_eq!(offset_of!(MkControl, seed), 16);
        assert_eq!(offset_of!(MkControl, row_ids), 24);
        assert_eq!(offset_of!(MkControl, n_stop), 56);
        assert_eq!(offset_of!(MkControl, stop_ids), 60);
        assert_eq!(size_of::<MkControl>(), 128);
        let p = SamplingParams {
            temperature: 0.7,
            top_k: Some(40),
            top_p: None,
            min_p: Some(0.05),
            repetition_penalty: None,
            seed: 0x1234_5678_9abc_def0,
        };
        let stops: Vec<u32> = (100..120).collect();
        let c = sampling_control(&p, &[3, 5], &stops).unwrap();
        let w = control_words(&c);
        assert_eq!(w[0], 0.7f32.to_bits());
        assert_eq!(w[1], 40);
        assert_eq!(w[2], 1.0f32.to_bits(), "top-p off is 1");
        assert_eq!(w[3], 0.05f32.to_bits());
        assert_eq!((w[4], w[5]), (0x9abc_def0, 0x1234_5678));
        assert_eq!(&w[6..14], &[3, 5, 0, 0, 0, 0, 0, 0]);
        assert_eq!(w[14], MAX_STOP as u32);
        assert_eq!(w[15], 100);
        assert_eq!(w[30], 115);
        assert_eq!(w[31], 0, "padding");
        // Stops beyond the device's 16 are the host's.
        assert_eq!(host_stop_mask(&[116, 7, 119, 100], &stops), 0b101);
        assert_eq!(host_stop_mask(&[116], &stops[..16]), 0);
        assert_eq!(row_mask(3), 0b111);
        let bad = SamplingParams {
            repetition_penalty: Some(1.3),
            ..p
        };
        assert_eq!(
            sampling_control(&bad, &[0], &[]),
            Err(GraphError::RepetitionPenalty(1.3))
        );
        let bad = SamplingParams {
            temperature: -1.0,
            ..p
        };
        assert!(matches!(
            sampling_control(&bad, &[0], &[]),
            Err(GraphError::Sampling(_))
        ));
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
        book.start(5, 10_000);
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
        book.start(7, 10_000);
        let e = book.enqueue().unwrap();
        assert_eq!(e, before + 1);
        assert_ne!(dev.ring[book.epoch_word(e)], e, "stale entry looks fresh");
    }

    #[test]
    fn at_most_ring_minus_one_in_flight_and_the_capacity_bounds_launches() {
        let mut book = RingBook::new(1);
        book.start(0, 10_000);
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
        book.start(14, 16);
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
    fn epochs_wrap_around_u32() {
        let mut book = RingBook::new(1);
        book.launched = u32::MAX - 1;
        book.consumed = u32::MAX - 1;
        book.start(0, 100);
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
