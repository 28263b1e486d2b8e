//! A timing wheel for promotion timers.
//!
//! A volume that is bursting sits in a lower-priority ring until its baseline meter refills;
//! then it must move to the baseline ring so that a saturated node still serves its baseline
//! first. With thousands of volumes running near their baseline that is one timer per
//! request, and a binary heap of cache-cold entries made it the largest per-I/O cost.
//!
//! The wheel has 2^16 ns (65.5 µs) slots over a 1,024-slot (67 ms) horizon; timers beyond it
//! wait in a heap. Pushing is O(1). The slot holding the current time is sorted once when time
//! reaches it, so timers still fire exactly at their time, never early or late, at
//! O(log k) per timer for k timers in a slot.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

const SHIFT: u32 = 16;
const SLOTS: usize = 1024;
const WORDS: usize = SLOTS / 64;

/// One timer: `(at_ns, slot, incarnation)`.
pub(crate) type Timer = (u64, u32, u32);

/// O(1)-push timers that fire exactly at their time.
#[derive(Debug)]
pub(crate) struct Wheel {
    slots: Vec<Vec<Timer>>,
    occupied: [u64; WORDS],
    /// The slot number `current` holds; every earlier slot is done, later ones are in `slots`.
    base_slot: u64,
    /// Timers of `base_slot` (and any set in the past), sorted latest first.
    current: Vec<Timer>,
    len: usize,
    overflow: BinaryHeap<Reverse<Timer>>,
    fired: Vec<Timer>,
}

impl Default for Wheel {
    fn default() -> Self {
        Wheel {
            slots: (0..SLOTS).map(|_| Vec::new()).collect(),
            occupied: [0; WORDS],
            base_slot: 0,
            current: Vec::new(),
            len: 0,
            overflow: BinaryHeap::new(),
            fired: Vec::new(),
        }
    }
}

impl Wheel {
    /// Adds a timer.
    pub(crate) fn push(&mut self, t: Timer) {
        let slot = t.0 >> SHIFT;
        if slot <= self.base_slot {
            // Keep `current` sorted latest first.
            let pos = self.current.partition_point(|c| c.0 > t.0);
            self.current.insert(pos, t);
            return;
        }
        if slot >= self.base_slot + SLOTS as u64 {
            self.overflow.push(Reverse(t));
            return;
        }
        let pos = (slot % SLOTS as u64) as usize;
        self.slots[pos].push(t);
        self.occupied[pos / 64] |= 1 << (pos % 64);
        self.len += 1;
    }

    /// Absolute slot number of the first occupied slot after `base_slot`.
    fn next_occupied(&self) -> Option<u64> {
        if self.len == 0 {
            return None;
        }
        let start = ((self.base_slot + 1) % SLOTS as u64) as usize;
        for step in 0..=WORDS {
            let word = (start / 64 + step) % WORDS;
            let mut bits = self.occupied[word];
            if step == 0 {
                bits &= u64::MAX << (start % 64);
            } else if step == WORDS {
                bits &= !(u64::MAX << (start % 64));
            }
            if bits != 0 {
                let pos = word * 64 + bits.trailing_zeros() as usize;
                let dist = (pos + SLOTS - start) % SLOTS;
                return Some(self.base_slot + 1 + dist as u64);
            }
        }
        None
    }

    fn migrate_overflow(&mut self) {
        let horizon = self.base_slot + SLOTS as u64;
        while let Some(&Reverse(t)) = self.overflow.peek() {
            if (t.0 >> SHIFT) >= horizon {
                break;
            }
            self.overflow.pop();
            self.push(t);
        }
    }

    /// Moves every timer due at or before `now_ns` to the fired list.
    fn advance(&mut self, now_ns: u64) {
        let now_slot = now_ns >> SHIFT;
        loop {
            self.migrate_overflow();
            while let Some(&t) = self.current.last() {
                if t.0 > now_ns {
                    break;
                }
                self.current.pop();
                self.fired.push(t);
            }
            if !self.current.is_empty() || self.base_slot >= now_slot {
                return;
            }
            match self.next_occupied() {
                Some(s) if s <= now_slot => {
                    let pos = (s % SLOTS as u64) as usize;
                    self.len -= self.slots[pos].len();
                    self.current.append(&mut self.slots[pos]);
                    self.current.sort_unstable_by(|a, b| b.cmp(a));
                    self.occupied[pos / 64] &= !(1 << (pos % 64));
                    self.base_slot = s;
                }
                _ => self.base_slot = now_slot,
            }
        }
    }

    /// Pops one timer due by `now_ns`.
    pub(crate) fn pop_due(&mut self, now_ns: u64) -> Option<Timer> {
        if self.fired.is_empty() {
            self.advance(now_ns);
        }
        self.fired.pop()
    }

    /// A time at or before the next timer (exact for the current slot, the start of the slot
    /// otherwise); `None` if there is none.
    pub(crate) fn next_fire(&self) -> Option<u64> {
        if let Some(t) = self.fired.last() {
            return Some(t.0);
        }
        [
            self.current.last().map(|t| t.0),
            self.next_occupied().map(|s| s.saturating_mul(1 << SHIFT)),
            self.overflow.peek().map(|Reverse(t)| t.0),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(w: &mut Wheel, now: u64) -> Vec<u32> {
        let mut v = Vec::new();
        while let Some(t) = w.pop_due(now) {
            v.push(t.1);
        }
        v.sort_unstable();
        v
    }

    #[test]
    fn fires_exactly_at_its_time() {
        let mut w = Wheel::default();
        w.push((100_000, 1, 0));
        w.push((70_000, 2, 0));
        w.push((200_000, 3, 0));
        // Not in the current slot yet: the slot start is a safe lower bound.
        assert_eq!(w.next_fire(), Some(65_536));
        assert!(drain(&mut w, 69_999).is_empty());
        assert_eq!(w.next_fire(), Some(70_000));
        assert_eq!(drain(&mut w, 70_000), vec![2]);
        assert_eq!(w.next_fire(), Some(100_000));
        assert_eq!(drain(&mut w, 100_000), vec![1]);
        assert_eq!(drain(&mut w, 199_999), Vec::<u32>::new());
        assert_eq!(drain(&mut w, 10_000_000), vec![3]);
        assert_eq!(w.next_fire(), None);
    }

    #[test]
    fn far_timers_wait_in_the_overflow_and_past_ones_fire_next() {
        let mut w = Wheel::default();
        let far = 10 * 1_000_000_000u64;
        w.push((far, 7, 1));
        w.push((5, 8, 1));
        assert_eq!(w.next_fire(), Some(5));
        assert_eq!(drain(&mut w, 5), vec![8]);
        assert_eq!(w.next_fire(), Some(far));
        assert!(drain(&mut w, far - 1).is_empty());
        assert_eq!(drain(&mut w, far), vec![7]);
        // A timer set in the past fires at the next call.
        w.push((0, 9, 1));
        assert_eq!(drain(&mut w, far), vec![9]);
    }

    #[test]
    fn many_timers_across_the_ring_all_fire_once() {
        let mut w = Wheel::default();
        for i in 0..5_000u32 {
            w.push((u64::from(i) * 37_003, i, 0));
        }
        let mut seen = Vec::new();
        let mut now = 0;
        while seen.len() < 5_000 {
            now += 1_000_000;
            seen.extend(drain(&mut w, now));
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..5_000).collect::<Vec<_>>());
        assert_eq!(w.next_fire(), None);
    }
}
