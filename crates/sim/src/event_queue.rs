//! The event queue at the heart of the discrete-event simulation.
//!
//! (Named `event_queue` rather than `engine`: `headroom-qos` has an `engine` module, the ring
//! scheduler its policies share, and this is nothing of the kind.)
//!
//! Events are ordered by `(time_ns, insertion order)`: two events at the same simulated
//! nanosecond run in the order they were scheduled. That tie-break is what makes a run a pure
//! function of its seed — no hash order, no pointer order, no wall clock.
//!
//! The queue is a *radix heap with 64-way digits* over the event time. A discrete-event
//! simulation is a monotone priority queue (nothing is ever scheduled before the event being
//! processed), which a radix heap exploits: relative to a base time `last` (a lower bound of
//! every pending time), an entry lives in the bucket `(level, digit)` named by the highest
//! 6-bit digit in which its time differs from `last` and by its own value of that digit. A push
//! is one append; when the lowest level is empty, the lowest non-empty bucket is spread over
//! the (empty) levels below it relative to its minimum (or, when it holds one entry, that
//! entry is popped directly), so an entry moves at most once per level, zero to three times
//! over its life at the simulator's time scales (a binary radix heap moves it once per bit,
//! ~10 times; the queue was the largest single cost per I/O). Level 0 buckets hold exactly
//! one time each and are popped front to back.
//!
//! FIFO ties need no sequence number: entries of equal time always share a bucket (the bucket
//! is a function of the time and `last`, and `last` only changes when a bucket is spread), a
//! push appends after every entry already there, and spreading appends into buckets that are
//! empty, in order. So the queue pops exactly the sequence a binary heap of `(time, seq)` pops
//! (a property test checks this) with 16-byte entries. Bucket storage is reused, so the queue
//! does not allocate per event once warmed up.

const DIGIT_BITS: u32 = 6;
const FAN: usize = 1 << DIGIT_BITS;
/// 11 levels of 6 bits cover all 64 bits of a time.
const LEVELS: usize = 64_usize.div_ceil(DIGIT_BITS as usize);

#[derive(Clone, Copy)]
struct Entry<E> {
    time_ns: u64,
    event: E,
}

/// A priority queue of events keyed by simulated time with FIFO tie-breaking.
pub struct EventQueue<E> {
    /// `LEVELS * FAN` buckets, index `level * FAN + digit`.
    buckets: Vec<Vec<Entry<E>>>,
    /// Bit `d` of `occupied[l]` set when bucket `(l, d)` is non-empty.
    occupied: [u64; LEVELS],
    /// Bit `l` set when `occupied[l] != 0`.
    levels: u32,
    /// Base of the placement: no pending entry is earlier, never decreasing.
    last: u64,
    /// Entries already popped from the lowest level-0 bucket (popped front to back).
    head: usize,
    len: usize,
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

impl<E: Copy> Default for EventQueue<E> {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

/// `(level, digit)` of `time_ns` relative to `last_ns` (`time_ns >= last_ns`), as a bucket
/// index.
#[inline]
fn bucket_of(time_ns: u64, last_ns: u64) -> (usize, usize) {
    let x = time_ns ^ last_ns;
    let level = if x == 0 {
        0
    } else {
        ((63 - x.leading_zeros()) / DIGIT_BITS) as usize
    };
    let digit = ((time_ns >> (level as u32 * DIGIT_BITS)) as usize) & (FAN - 1);
    (level, digit)
}

impl<E: Copy> EventQueue<E> {
    /// An empty queue with room for about `capacity` pending events.
    pub fn with_capacity(capacity: usize) -> Self {
        let mut buckets: Vec<Vec<Entry<E>>> = (0..LEVELS * FAN).map(|_| Vec::new()).collect();
        // Spread entries land in the low levels; give them some room up front.
        let per = (capacity / FAN).max(1);
        for b in buckets.iter_mut().take(3 * FAN) {
            b.reserve(per);
        }
        EventQueue {
            buckets,
            occupied: [0; LEVELS],
            levels: 0,
            last: 0,
            head: 0,
            len: 0,
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

    #[inline]
    fn place(&mut self, e: Entry<E>) {
        let (level, digit) = bucket_of(e.time_ns, self.last);
        self.buckets[level * FAN + digit].push(e);
        self.occupied[level] |= 1 << digit;
        self.levels |= 1 << level;
    }

    /// Schedules `event` at `at_ns`. A time in the past is moved to "now": the simulation
    /// never runs backwards.
    #[inline]
    pub fn push(&mut self, at_ns: u64, event: E) {
        // `last <= now` between pops (it is the time of the event popped last, or 0).
        let time_ns = at_ns.max(self.now_ns);
        self.place(Entry { time_ns, event });
        self.len += 1;
    }

    /// Makes level 0 hold the minimum by spreading the lowest non-empty bucket, unless that
    /// bucket holds a single entry: then that entry is the minimum and is returned instead
    /// (taken out, with `last` moved to its time). Taking it directly is sound because every
    /// other entry differs from its time in the same digit as from the old `last`, so their
    /// buckets stay right; in a sparse queue it saves most of the moves.
    #[inline]
    fn settle(&mut self) -> Option<Entry<E>> {
        if self.occupied[0] != 0 || self.levels == 0 {
            return None;
        }
        let level = self.levels.trailing_zeros() as usize;
        let digit = self.occupied[level].trailing_zeros() as usize;
        self.occupied[level] &= !(1u64 << digit);
        if self.occupied[level] == 0 {
            self.levels &= !(1u32 << level);
        }
        let index = level * FAN + digit;
        if self.buckets[index].len() == 1 {
            let e = self.buckets[index].pop();
            if let Some(e) = e {
                self.last = e.time_ns;
            }
            return e;
        }
        let mut moving = std::mem::take(&mut self.buckets[index]);
        let min = moving.iter().map(|e| e.time_ns).min().unwrap_or(self.last);
        self.last = min;
        for &e in &moving {
            self.place(e);
        }
        moving.clear();
        // Give the storage back so the bucket keeps its capacity.
        self.buckets[index] = moving;
        None
    }

    /// Time of the earliest pending event (does not move the clock).
    pub fn peek_time_ns(&mut self) -> Option<u64> {
        if self.occupied[0] != 0 {
            let digit = self.occupied[0].trailing_zeros() as usize;
            return self.buckets[digit].get(self.head).map(|e| e.time_ns);
        }
        if self.levels == 0 {
            return None;
        }
        // Look without spreading, so that `last` stays at or below `now`.
        let level = self.levels.trailing_zeros() as usize;
        let digit = self.occupied[level].trailing_zeros() as usize;
        self.buckets[level * FAN + digit]
            .iter()
            .map(|e| e.time_ns)
            .min()
    }

    /// Removes the earliest event and advances the clock to its time.
    #[inline]
    pub fn pop(&mut self) -> Option<(u64, E)> {
        let e = match self.settle() {
            Some(e) => e,
            None => {
                if self.occupied[0] == 0 {
                    return None;
                }
                let digit = self.occupied[0].trailing_zeros() as usize;
                let bucket = &mut self.buckets[digit];
                let e = *bucket.get(self.head)?;
                self.head += 1;
                if self.head == bucket.len() {
                    bucket.clear();
                    self.head = 0;
                    self.occupied[0] &= !(1u64 << digit);
                    if self.occupied[0] == 0 {
                        self.levels &= !1;
                    }
                }
                e
            }
        };
        self.len -= 1;
        self.now_ns = e.time_ns;
        self.processed += 1;
        Some((e.time_ns, e.event))
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

    #[test]
    fn peek_does_not_block_a_push_before_the_peeked_time() {
        let mut q = EventQueue::with_capacity(4);
        q.push(10, 0u32);
        assert_eq!(q.pop(), Some((10, 0)));
        q.push(1_000_000, 1);
        assert_eq!(q.peek_time_ns(), Some(1_000_000));
        q.push(20, 2);
        q.push(20, 3);
        assert_eq!(q.peek_time_ns(), Some(20));
        assert_eq!(q.pop(), Some((20, 2)));
        assert_eq!(q.pop(), Some((20, 3)));
        assert_eq!(q.pop(), Some((1_000_000, 1)));
        assert_eq!(q.len(), 0);
    }

    proptest! {
        /// The radix heap pops exactly what a binary heap of (time, seq) pops, for any
        /// interleaving of pushes (never in the past) and pops.
        #[test]
        fn matches_a_binary_heap(ops in proptest::collection::vec((0u8..4, 0u64..1_000_000), 1..400)) {
            let mut q = EventQueue::with_capacity(4);
            let mut reference: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
            let mut seq = 0u64;
            let mut now = 0u64;
            for (kind, delta) in ops {
                if kind < 3 {
                    // bias towards small deltas so that ties happen; kind 2 reaches the high
                    // levels (up to ~2^50 ns ahead)
                    let t = now + match kind {
                        0 => delta % 4,
                        1 => delta,
                        _ => delta << 30,
                    };
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
