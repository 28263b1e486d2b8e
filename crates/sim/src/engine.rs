//! The event queue at the heart of the discrete-event simulation.
//!
//! Events are ordered by `(time_ns, seq)`, where `seq` is the insertion counter: two events at
//! the same simulated nanosecond run in the order they were scheduled. That tie-break is what
//! makes a run a pure function of its seed — no hash order, no pointer order, no wall clock.
//!
//! The queue is a *radix heap* over the 128-bit key `time_ns << 64 | seq`. A discrete-event
//! simulation is a monotone priority queue (nothing is ever scheduled before the event being
//! processed), which a radix heap exploits: an entry lives in the bucket named by the highest
//! bit in which its key differs from the last key popped, so a push is one append and each
//! entry is moved to a lower bucket only a few times before it is popped. It pops exactly the
//! same sequence as a binary heap of `(time_ns, seq)` (a property test checks this) at a
//! fraction of the cost. Bucket storage is reused, so the queue does not allocate per event
//! once warmed up.

const BUCKETS: usize = 129;

struct Entry<E> {
    key: u128,
    event: E,
}

/// A priority queue of events keyed by simulated time with FIFO tie-breaking.
pub struct EventQueue<E> {
    /// Bucket 0 holds keys equal to `last`; bucket `b >= 1` keys whose highest bit differing
    /// from `last` is bit `b - 1`.
    buckets: Vec<Vec<Entry<E>>>,
    /// Bit `b - 1` set when bucket `b >= 1` is non-empty.
    nonempty: u128,
    /// Key of the last entry moved to bucket 0 (the minimum), never decreasing.
    last: u128,
    len: usize,
    seq: u64,
    now_ns: u64,
    processed: u64,
}

impl<E> std::fmt::Debug for EventQueue<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventQueue")
            .field("pending", &self.len)
            .field("now_ns", &self.now_ns)
            .field("processed", &self.processed)
            .finish()
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

#[inline]
fn bucket_of(key: u128, last: u128) -> usize {
    if key == last {
        0
    } else {
        128 - (key ^ last).leading_zeros() as usize
    }
}

impl<E> EventQueue<E> {
    /// An empty queue with room for about `capacity` pending events.
    pub fn with_capacity(capacity: usize) -> Self {
        let mut buckets: Vec<Vec<Entry<E>>> = (0..BUCKETS).map(|_| Vec::new()).collect();
        if let Some(b) = buckets.last_mut() {
            b.reserve(capacity);
        }
        EventQueue {
            buckets,
            nonempty: 0,
            last: 0,
            len: 0,
            seq: 0,
            now_ns: 0,
            processed: 0,
        }
    }

    /// Current simulated time: the time of the last event popped.
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// Number of events popped so far.
    pub fn processed(&self) -> u64 {
        self.processed
    }

    /// Number of events waiting.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no event is waiting.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Schedules `event` at `at_ns`. A time in the past is moved to "now": the simulation
    /// never runs backwards.
    #[inline]
    pub fn push(&mut self, at_ns: u64, event: E) {
        let time_ns = at_ns.max(self.now_ns);
        let key = (u128::from(time_ns) << 64) | u128::from(self.seq);
        self.seq += 1;
        // `key > last` always holds: time >= now >= last's time and seq is fresh.
        let b = bucket_of(key, self.last);
        self.buckets[b].push(Entry { key, event });
        if b > 0 {
            self.nonempty |= 1u128 << (b - 1);
        }
        self.len += 1;
    }

    /// Makes bucket 0 hold the minimum (if any entry is pending).
    #[inline]
    fn settle(&mut self) {
        if !self.buckets[0].is_empty() || self.nonempty == 0 {
            return;
        }
        let b = self.nonempty.trailing_zeros() as usize + 1;
        let mut moving = std::mem::take(&mut self.buckets[b]);
        self.nonempty &= !(1u128 << (b - 1));
        let min = moving.iter().map(|e| e.key).min().unwrap_or(self.last);
        self.last = min;
        for e in moving.drain(..) {
            let nb = bucket_of(e.key, min);
            self.buckets[nb].push(e);
            if nb > 0 {
                self.nonempty |= 1u128 << (nb - 1);
            }
        }
        // Give the (now empty) vector's storage back so the bucket keeps its capacity.
        self.buckets[b] = moving;
    }

    /// Time of the earliest pending event.
    pub fn peek_time_ns(&mut self) -> Option<u64> {
        self.settle();
        self.buckets[0].last().map(|e| (e.key >> 64) as u64)
    }

    /// Removes the earliest event and advances the clock to its time.
    #[inline]
    pub fn pop(&mut self) -> Option<(u64, E)> {
        self.settle();
        let e = self.buckets[0].pop()?;
        self.len -= 1;
        let t = (e.key >> 64) as u64;
        self.now_ns = t;
        self.processed += 1;
        Some((t, e.event))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    #[test]
    fn pops_in_time_order_with_fifo_ties() {
        let mut q = EventQueue::with_capacity(8);
        q.push(30, "c");
        q.push(10, "a1");
        q.push(20, "b");
        q.push(10, "a2");
        q.push(10, "a3");
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(
            order,
            vec![(10, "a1"), (10, "a2"), (10, "a3"), (20, "b"), (30, "c")]
        );
        assert_eq!(q.now_ns(), 30);
        assert_eq!(q.processed(), 5);
    }

    #[test]
    fn past_events_are_clamped_to_now() {
        let mut q = EventQueue::with_capacity(2);
        q.push(100, 1u32);
        assert_eq!(q.pop(), Some((100, 1)));
        q.push(50, 2);
        assert_eq!(q.pop(), Some((100, 2)));
    }

    #[test]
    fn interleaved_pushes_keep_order() {
        // An event scheduled at the current time while others are pending at the same
        // time runs after them (FIFO), never before.
        let mut q = EventQueue::with_capacity(4);
        q.push(5, 0u32);
        q.push(5, 1);
        let (_, first) = q.pop().unwrap();
        assert_eq!(first, 0);
        q.push(5, 2);
        assert_eq!(q.peek_time_ns(), Some(5));
        assert_eq!(q.pop(), Some((5, 1)));
        assert_eq!(q.pop(), Some((5, 2)));
        assert!(q.is_empty());
        assert_eq!(q.pop(), None);
    }

    proptest! {
        /// The radix heap pops exactly what a binary heap of (time, seq) pops, for any
        /// interleaving of pushes (never in the past) and pops.
        #[test]
        fn matches_a_binary_heap(ops in proptest::collection::vec((0u8..3, 0u64..1_000_000), 1..400)) {
            let mut q = EventQueue::with_capacity(4);
            let mut reference: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
            let mut seq = 0u64;
            let mut now = 0u64;
            for (kind, delta) in ops {
                if kind < 2 {
                    // bias towards small deltas so that ties happen
                    let t = now + if kind == 0 { delta % 4 } else { delta };
                    q.push(t, seq);
                    reference.push(Reverse((t, seq)));
                    seq += 1;
                } else {
                    let got = q.pop();
                    let want = reference.pop().map(|Reverse((t, s))| (t, s));
                    prop_assert_eq!(got, want);
                    if let Some((t, _)) = got {
                        now = t;
                    }
                }
            }
            while let Some(Reverse((t, s))) = reference.pop() {
                prop_assert_eq!(q.pop(), Some((t, s)));
            }
            prop_assert!(q.is_empty());
        }
    }
}
