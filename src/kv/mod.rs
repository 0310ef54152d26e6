//! The contiguous KV cache: every slot (sequence) pre-allocates `capacity` positions per layer
//! and KV head, laid out so that one head's keys for all positions are contiguous — the order
//! attention reads them in.

use crate::graph::KvSpec;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    #[error("KV cache full: slot {slot} holds {len} of {capacity} positions and {needed} more were asked for")]
    Full {
        slot: usize,
        len: usize,
        capacity: usize,
        needed: usize,
    },
    #[error("KV cache slot {slot} does not exist (cache has {slots})")]
    NoSlot { slot: usize, slots: usize },
}

pub struct KvCache {
    spec: KvSpec,
    slots: usize,
    capacity: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    /// `spec.state_dim` floats per slot and position (nanochat's smear input), kept per position
    /// so truncation and prefix reuse stay exact.
    state: Vec<f32>,
    lens: Vec<usize>,
}

impl KvCache {
    pub fn new(spec: KvSpec, slots: usize, capacity: usize) -> KvCache {
        let n = spec.layers * slots * spec.kv_heads * capacity * spec.head_dim;
        KvCache {
            spec,
            slots,
            capacity,
            k: vec![0.0; n],
            v: vec![0.0; n],
            state: vec![0.0; slots * capacity * spec.state_dim],
            lens: vec![0; slots],
        }
    }

    pub fn spec(&self) -> KvSpec {
        self.spec
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Positions filled in `slot`.
    pub fn len(&self, slot: usize) -> usize {
        self.lens[slot]
    }

    pub fn is_empty(&self, slot: usize) -> bool {
        self.lens[slot] == 0
    }

    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len() + self.state.len()) * 4
    }

    /// The per-position state of `slot` at `pos` (`state_dim` floats).
    pub fn state(&self, slot: usize, pos: usize) -> &[f32] {
        let d = self.spec.state_dim;
        let at = (slot * self.capacity + pos) * d;
        &self.state[at..at + d]
    }

    pub fn write_state(&mut self, slot: usize, pos: usize, values: &[f32]) {
        let d = self.spec.state_dim;
        let at = (slot * self.capacity + pos) * d;
        self.state[at..at + d].copy_from_slice(values);
    }

    /// Checks that `n` more positions fit in `slot`.
    pub fn reserve(&self, slot: usize, n: usize) -> Result<(), KvError> {
        let len = *self.lens.get(slot).ok_or(KvError::NoSlot {
            slot,
            slots: self.slots,
        })?;
        if len + n > self.capacity {
            return Err(KvError::Full {
                slot,
                len,
                capacity: self.capacity,
                needed: n,
            });
        }
        Ok(())
    }

    /// Marks `n` more positions of `slot` as filled (after every layer wrote them).
    pub fn advance(&mut self, slot: usize, n: usize) {
        self.lens[slot] += n;
        debug_assert!(self.lens[slot] <= self.capacity);
    }

    /// Sets how many positions of `slot` count as filled (what was written past it stays in
    /// memory, unread). Used to run ahead of what the engine has confirmed.
    pub(crate) fn set_len(&mut self, slot: usize, len: usize) {
        assert!(len <= self.capacity, "slot {slot}: length {len} > capacity");
        self.lens[slot] = len;
    }

    /// Forgets positions from `len` on (rollback); the memory is simply overwritten later.
    pub fn truncate(&mut self, slot: usize, len: usize) {
        self.lens[slot] = self.lens[slot].min(len);
    }

    fn base(&self, layer: usize, slot: usize, head: usize) -> usize {
        ((layer * self.slots + slot) * self.spec.kv_heads + head)
            * self.capacity
            * self.spec.head_dim
    }

    /// Writes one position's keys and values (`kv_heads × head_dim` each).
    pub fn write(&mut self, layer: usize, slot: usize, pos: usize, k: &[f32], v: &[f32]) {
        let d = self.spec.head_dim;
        assert!(
            pos < self.capacity,
            "KV write at {pos} past capacity {}",
            self.capacity
        );
        for h in 0..self.spec.kv_heads {
            let at = self.base(layer, slot, h) + pos * d;
            self.k[at..at + d].copy_from_slice(&k[h * d..(h + 1) * d]);
            self.v[at..at + d].copy_from_slice(&v[h * d..(h + 1) * d]);
        }
    }

    /// Keys and values of positions `0..len` of one head, each `len × head_dim`.
    pub fn head(&self, layer: usize, slot: usize, head: usize, len: usize) -> (&[f32], &[f32]) {
        let at = self.base(layer, slot, head);
        let n = len * self.spec.head_dim;
        (&self.k[at..at + n], &self.v[at..at + n])
    }

    /// Copies the first `len` positions of `from` into `to` (one prefill, many samples).
    pub fn copy_slot(&mut self, from: usize, to: usize, len: usize) {
        let d = self.spec.head_dim;
        for layer in 0..self.spec.layers {
            for h in 0..self.spec.kv_heads {
                let (src, dst) = (self.base(layer, from, h), self.base(layer, to, h));
                self.k.copy_within(src..src + len * d, dst);
                self.v.copy_within(src..src + len * d, dst);
            }
        }
        let d = self.spec.state_dim;
        let (src, dst) = (from * self.capacity * d, to * self.capacity * d);
        self.state.copy_within(src..src + len * d, dst);
        self.lens[to] = len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> KvSpec {
        KvSpec {
            layers: 2,
            kv_heads: 2,
            head_dim: 3,
            state_dim: 2,
        }
    }

    #[test]
    fn writes_land_per_head_and_copy_between_slots() {
        let mut c = KvCache::new(spec(), 2, 4);
        c.reserve(0, 4).unwrap();
        for pos in 0..2 {
            let k: Vec<f32> = (0..6).map(|i| (pos * 10 + i) as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            c.write(1, 0, pos, &k, &v);
        }
        c.write_state(0, 1, &[7.0, 8.0]);
        c.advance(0, 2);
        let (k, v) = c.head(1, 0, 1, 2);
        assert_eq!(k, &[3.0, 4.0, 5.0, 13.0, 14.0, 15.0]);
        assert_eq!(v, &[-3.0, -4.0, -5.0, -13.0, -14.0, -15.0]);
        let k = k.to_vec();
        c.copy_slot(0, 1, 2);
        assert_eq!(c.len(1), 2);
        assert_eq!(c.state(1, 1), &[7.0, 8.0]);
        assert_eq!(c.head(1, 1, 1, 2).0, k.as_slice());
    }

    #[test]
    fn full_cache_is_an_error_not_a_silent_overwrite() {
        let mut c = KvCache::new(spec(), 1, 4);
        c.advance(0, 3);
        assert_eq!(
            c.reserve(0, 2),
            Err(KvError::Full {
                slot: 0,
                len: 3,
                capacity: 4,
                needed: 2
            })
        );
        assert!(c.reserve(0, 1).is_ok());
        assert!(matches!(c.reserve(5, 1), Err(KvError::NoSlot { .. })));
    }
}
