//! Which replica serves a read, and whether an I/O continues a stream (FAST, HotCloud'12).
//!
//! Why here: the simulator's devices and replicas and the server's emulated devices and
//! replicated volumes must judge "sequential" and route reads with the same code, so that a
//! result of the simulator's reproduction (g) and its real-I/O counterpart differ only by what
//! the simulator cannot model. Both are pure: no clock, no I/O, the caller passes the state.
//!
//! **Streams** ([`StreamTracker`]). A disk (or a device with readahead) serves an I/O cheaply
//! when it starts near where a recent I/O ended. The tracker keeps the ends of the last few
//! streams, least recently used out: an I/O that starts within the window of one of them
//! continues it (sequential); any other I/O starts a new stream in the least recently used
//! slot (random). With one slot it is IOCost's test against the previous end alone
//! ([`crate::model::is_sequential`]).
//!
//! **Routing** ([`route_read`]). FAST's *default-with-steal*: random reads go to the head
//! replica (0) and sequential reads to the middle one (1), so that random reads stop breaking
//! up sequential ones on the same device; when the default replica is busy and another healthy
//! replica is idle, the idle one takes the read (steals). Primary-only and round-robin are the
//! baselines FAST compares against. Failed replicas are never chosen.

use serde::{Deserialize, Serialize};

/// How reads are spread over a volume's replicas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadRouting {
    /// The first healthy replica.
    #[default]
    Primary,
    /// Rotate over the healthy replicas, one read each.
    RoundRobin,
    /// FAST: random reads to replica 0, sequential reads to replica 1, an idle replica steals.
    TypeAware,
}

/// What the router needs to know of one replica now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplicaLoad {
    /// Its device can serve reads (not failed, not being rebuilt).
    pub healthy: bool,
    /// Requests it has queued or in service now.
    pub in_flight: u32,
}

/// The replica a read goes to, or `None` when no replica is healthy.
///
/// `sequential`: the read continues a stream (from a [`StreamTracker`] of the reader);
/// `turn`: a counter the caller advances per read (round robin only).
pub fn route_read(
    routing: ReadRouting,
    sequential: bool,
    turn: u64,
    replicas: &[ReplicaLoad],
) -> Option<usize> {
    let n = replicas.len();
    if n == 0 {
        return None;
    }
    let first_healthy_from = |start: usize| {
        (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| replicas[i].healthy)
    };
    match routing {
        ReadRouting::Primary => first_healthy_from(0),
        ReadRouting::RoundRobin => first_healthy_from((turn % n as u64) as usize),
        ReadRouting::TypeAware => {
            let home = first_healthy_from(if sequential { 1 % n } else { 0 })?;
            if replicas[home].in_flight == 0 {
                return Some(home);
            }
            // Steal: the first idle healthy replica after the default one, if any.
            let idle = (1..n)
                .map(|k| (home + k) % n)
                .find(|&i| replicas[i].healthy && replicas[i].in_flight == 0);
            Some(idle.unwrap_or(home))
        }
    }
}

/// The ends of the last few streams seen by a device or a reader, least recently used out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamTracker {
    /// `(end of the stream's last I/O, use stamp)` per slot.
    ends: Vec<(u64, u64)>,
    stamp: u64,
    window_bytes: u64,
}

/// Most streams a tracker keeps (a slot is scanned per I/O).
pub const MAX_STREAMS: usize = 256;

impl StreamTracker {
    /// A tracker of `streams` streams (clamped to `1..=MAX_STREAMS`); an I/O starting within
    /// `window_bytes` of a stream's end continues it.
    pub fn new(streams: usize, window_bytes: u64) -> StreamTracker {
        StreamTracker {
            ends: vec![(u64::MAX / 2, 0); streams.clamp(1, MAX_STREAMS)],
            stamp: 0,
            window_bytes,
        }
    }

    /// Number of streams tracked.
    pub fn streams(&self) -> usize {
        self.ends.len()
    }

    /// Records an I/O of `len_bytes` at `offset_bytes`; returns whether it continued a stream.
    pub fn observe(&mut self, offset_bytes: u64, len_bytes: u64) -> bool {
        self.stamp += 1;
        let end = offset_bytes.saturating_add(len_bytes);
        let hit = self
            .ends
            .iter()
            .position(|(e, _)| offset_bytes.abs_diff(*e) <= self.window_bytes);
        let slot = hit.unwrap_or_else(|| {
            let mut lru = 0;
            for (i, (_, used)) in self.ends.iter().enumerate() {
                if *used < self.ends[lru].1 {
                    lru = i;
                }
            }
            lru
        });
        self.ends[slot] = (end, self.stamp);
        hit.is_some()
    }

    /// The head moved to `position_bytes` for something that is not a stream (a log append).
    /// A one-stream tracker judges the next I/O against it; a tracker of several streams
    /// models a device whose readahead keeps its streams, so it is left as it is.
    pub fn move_head(&mut self, position_bytes: u64) {
        if let [only] = self.ends.as_mut_slice() {
            only.0 = position_bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const W: u64 = 16 << 20;

    fn loads(v: &[(bool, u32)]) -> Vec<ReplicaLoad> {
        v.iter()
            .map(|&(healthy, in_flight)| ReplicaLoad { healthy, in_flight })
            .collect()
    }

    #[test]
    fn type_aware_sends_random_to_the_head_and_sequential_to_the_middle() {
        let idle = loads(&[(true, 0), (true, 0), (true, 0)]);
        assert_eq!(route_read(ReadRouting::TypeAware, false, 7, &idle), Some(0));
        assert_eq!(route_read(ReadRouting::TypeAware, true, 7, &idle), Some(1));
    }

    #[test]
    fn an_idle_replica_steals_from_a_busy_default() {
        let busy_head = loads(&[(true, 3), (true, 1), (true, 0)]);
        assert_eq!(
            route_read(ReadRouting::TypeAware, false, 0, &busy_head),
            Some(2)
        );
        // Nobody idle: the default keeps it.
        let all_busy = loads(&[(true, 3), (true, 1), (true, 2)]);
        assert_eq!(
            route_read(ReadRouting::TypeAware, false, 0, &all_busy),
            Some(0)
        );
        assert_eq!(
            route_read(ReadRouting::TypeAware, true, 0, &all_busy),
            Some(1)
        );
    }

    #[test]
    fn failed_replicas_are_never_chosen() {
        let head_failed = loads(&[(false, 0), (true, 5)]);
        for routing in [
            ReadRouting::Primary,
            ReadRouting::RoundRobin,
            ReadRouting::TypeAware,
        ] {
            for turn in 0..4 {
                for seq in [false, true] {
                    assert_eq!(route_read(routing, seq, turn, &head_failed), Some(1));
                }
            }
            assert_eq!(route_read(routing, false, 0, &loads(&[(false, 0)])), None);
            assert_eq!(route_read(routing, false, 0, &[]), None);
        }
    }

    #[test]
    fn round_robin_rotates_and_primary_stays() {
        let three = loads(&[(true, 9), (true, 0), (true, 0)]);
        let rr: Vec<_> = (0..6)
            .map(|t| route_read(ReadRouting::RoundRobin, false, t, &three))
            .collect();
        assert_eq!(
            rr,
            [Some(0), Some(1), Some(2), Some(0), Some(1), Some(2)].to_vec()
        );
        assert_eq!(route_read(ReadRouting::Primary, true, 5, &three), Some(0));
    }

    #[test]
    fn a_single_replica_takes_everything() {
        let one = loads(&[(true, 4)]);
        for routing in [
            ReadRouting::Primary,
            ReadRouting::RoundRobin,
            ReadRouting::TypeAware,
        ] {
            assert_eq!(route_read(routing, true, 3, &one), Some(0));
        }
    }

    #[test]
    fn interleaved_scans_stay_sequential_with_enough_streams() {
        let mut t = StreamTracker::new(4, 0);
        // Two scans, interleaved: both are sequential after their first I/O.
        assert!(!t.observe(0, 4096));
        assert!(!t.observe(1 << 30, 4096));
        for i in 1..100u64 {
            assert!(t.observe(i * 4096, 4096));
            assert!(t.observe((1 << 30) + i * 4096, 4096));
        }
        // With one stream, the same interleaving is random throughout.
        let mut one = StreamTracker::new(1, 0);
        one.observe(0, 4096);
        one.observe(1 << 30, 4096);
        for i in 1..100u64 {
            assert!(!one.observe(i * 4096, 4096));
            assert!(!one.observe((1 << 30) + i * 4096, 4096));
        }
    }

    #[test]
    fn the_least_recently_used_stream_is_replaced() {
        let mut t = StreamTracker::new(2, 0);
        t.observe(0, 10); // stream A ends at 10
        t.observe(1000, 10); // stream B ends at 1010
        assert!(t.observe(10, 10)); // A continues (A is now the most recent)
        assert!(!t.observe(5000, 10)); // C replaces B, the least recently used
        assert!(t.observe(20, 10)); // A still there
        assert!(!t.observe(1010, 10)); // B is gone
    }

    #[test]
    fn move_head_moves_a_single_stream_only() {
        let mut one = StreamTracker::new(1, 0);
        one.observe(0, 4096);
        one.move_head(1 << 40);
        assert!(!one.observe(4096, 4096));
        let mut two = StreamTracker::new(2, 0);
        two.observe(0, 4096);
        two.move_head(1 << 40);
        assert!(two.observe(4096, 4096));
    }

    proptest! {
        /// One stream is IOCost's test against the previous end.
        #[test]
        fn one_stream_is_iocost(ios in proptest::collection::vec((0u64..1 << 36, 1u64..1 << 20), 1..200)) {
            let mut t = StreamTracker::new(1, W);
            let mut prev_end = u64::MAX / 2;
            for (offset, len) in ios {
                let expect = crate::model::is_sequential(prev_end, offset);
                prop_assert_eq!(t.observe(offset, len), expect);
                prev_end = offset + len;
            }
        }

        /// The router picks a healthy replica whenever there is one, and never a failed one.
        #[test]
        fn route_picks_a_healthy_replica(
            reps in proptest::collection::vec((any::<bool>(), 0u32..4), 0..4),
            seq in any::<bool>(),
            turn in any::<u64>(),
            routing in prop_oneof![Just(ReadRouting::Primary), Just(ReadRouting::RoundRobin), Just(ReadRouting::TypeAware)],
        ) {
            let r = loads(&reps);
            match route_read(routing, seq, turn, &r) {
                Some(i) => prop_assert!(r[i].healthy),
                None => prop_assert!(r.iter().all(|x| !x.healthy)),
            }
        }
    }
}
