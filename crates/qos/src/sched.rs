//! Building blocks shared by the policies: a volume table, ready rings with lazy deletion, a
//! timer heap, and the common per-volume state. The invariant tracker, which checks the
//! policies but decides nothing, is in `crate::tracker`.
//!
//! Per-I/O work must stay O(1) or O(log n) in the number of volumes (10,000 volumes at
//! ≤ 200 ns per I/O). So volumes that can run are kept in FIFO rings, volumes that must wait
//! sit in a min-heap keyed by the time they become eligible, and nothing ever scans all
//! volumes on the hot path. Moving a volume between rings would need a search; instead every
//! placement carries the volume's *generation*, which is bumped whenever the volume is placed
//! again, and entries with an old generation are skipped when popped (lazy deletion).

use crate::limiter::Charge;
use crate::policy::VolumeSnapshot;
use crate::vocab::{BurstMode, IoRequest, Phase, VolumeId, VolumeQos};
use crate::wheel::Wheel;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// Monotonic view of caller-provided time: a smaller `now_ns` is treated as the last one seen.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Clock {
    last_ns: u64,
}

impl Clock {
    pub(crate) fn at(&mut self, now_ns: u64) -> u64 {
        self.last_ns = self.last_ns.max(now_ns);
        self.last_ns
    }

    pub(crate) fn last(&self) -> u64 {
        self.last_ns
    }
}

/// Hasher for volume ids: one multiplication. Ids come from configuration, not from clients,
/// so hash flooding is not a concern, and SipHash was 9 % of the per-I/O cost.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = (self.0 ^ u64::from(n)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// Dense storage of volumes with an id index and per-slot generations that survive reuse.
///
/// A slot's generation and incarnation sit next to its item (not in side vectors), so that
/// checking a ring entry and then using the volume costs one cache miss, not three: with
/// thousands of volumes visited in random order every volume is cache-cold.
///
/// Ids are usually small and dense (0, 1, 2, …), so ids below `direct.len()` are found in a
/// plain array of slots (4 bytes per id, a tenth of the hash table's footprint, so it stays
/// cached); larger ids go to the hash map. Every id below `direct.len()` lives in `direct`.
#[derive(Debug)]
pub(crate) struct Slab<T> {
    slots: Vec<SlabSlot<T>>,
    free: Vec<u32>,
    direct: Vec<u32>,
    by_id: HashMap<VolumeId, u32, BuildHasherDefault<IdHasher>>,
    count: usize,
}

/// Empty entry of `Slab::direct`.
const NO_SLOT: u32 = u32::MAX;
/// `Slab::direct` covers ids up to this many per defined volume (and at least `DIRECT_MIN`).
const DIRECT_PER_VOLUME: usize = 4;
const DIRECT_MIN: usize = 1024;

#[derive(Debug)]
#[repr(C)]
struct SlabSlot<T> {
    generation: u32,
    /// Bumped when the slot gets a new volume: identifies the volume for timers that must
    /// survive re-placement (promotions).
    incarnation: u32,
    item: Option<T>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            slots: Vec::new(),
            free: Vec::new(),
            direct: Vec::new(),
            by_id: HashMap::default(),
            count: 0,
        }
    }
}

impl<T> Slab<T> {
    pub(crate) fn lookup(&self, id: VolumeId) -> Option<u32> {
        match self.direct.get(id as usize) {
            Some(&NO_SLOT) => None,
            Some(&idx) => Some(idx),
            None => self.by_id.get(&id).copied(),
        }
    }

    /// Grows `direct` to cover `id` if that keeps it within `DIRECT_PER_VOLUME` entries per
    /// volume, moving the hash map's ids it now covers.
    fn cover(&mut self, id: VolumeId) {
        let i = id as usize;
        let limit = DIRECT_MIN.max(DIRECT_PER_VOLUME * (self.count + 1));
        if i < self.direct.len() || i >= limit {
            return;
        }
        let new_len = (i + 1).max(2 * self.direct.len()).min(limit);
        self.direct.resize(new_len, NO_SLOT);
        let moved: Vec<(VolumeId, u32)> = self
            .by_id
            .iter()
            .filter(|&(&k, _)| (k as usize) < new_len)
            .map(|(&k, &v)| (k, v))
            .collect();
        for (k, v) in moved {
            self.by_id.remove(&k);
            self.direct[k as usize] = v;
        }
    }

    /// The slot the next `insert` will use.
    pub(crate) fn vacant_index(&self) -> u32 {
        match self.free.last() {
            Some(&i) => i,
            None => self.slots.len() as u32,
        }
    }

    pub(crate) fn insert(&mut self, id: VolumeId, item: T) -> u32 {
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(SlabSlot {
                    generation: 0,
                    incarnation: 0,
                    item: None,
                });
                (self.slots.len() - 1) as u32
            }
        };
        if let Some(slot) = self.slots.get_mut(idx as usize) {
            slot.item = Some(item);
            slot.incarnation = slot.incarnation.wrapping_add(1);
        }
        self.bump(idx);
        self.cover(id);
        match self.direct.get_mut(id as usize) {
            Some(d) => *d = idx,
            None => {
                self.by_id.insert(id, idx);
            }
        }
        self.count += 1;
        idx
    }

    pub(crate) fn remove(&mut self, id: VolumeId) -> Option<(u32, T)> {
        let idx = match self.direct.get_mut(id as usize) {
            Some(d) if *d == NO_SLOT => return None,
            Some(d) => std::mem::replace(d, NO_SLOT),
            None => self.by_id.remove(&id)?,
        };
        self.count -= 1;
        let item = self.slots.get_mut(idx as usize)?.item.take()?;
        self.bump(idx);
        self.free.push(idx);
        Some((idx, item))
    }

    pub(crate) fn get(&self, idx: u32) -> Option<&T> {
        self.slots.get(idx as usize).and_then(|s| s.item.as_ref())
    }

    pub(crate) fn get_mut(&mut self, idx: u32) -> Option<&mut T> {
        self.slots
            .get_mut(idx as usize)
            .and_then(|s| s.item.as_mut())
    }

    /// Invalidates every queued placement of a slot; returns the new generation.
    pub(crate) fn bump(&mut self, idx: u32) -> u32 {
        match self.slots.get_mut(idx as usize) {
            Some(s) => {
                s.generation = s.generation.wrapping_add(1);
                s.generation
            }
            None => 0,
        }
    }

    /// Which volume occupies a slot (see `SlabSlot::incarnation`).
    pub(crate) fn incarnation_of(&self, idx: u32) -> u32 {
        self.slots.get(idx as usize).map_or(0, |s| s.incarnation)
    }

    /// Whether a placement `(idx, gen)` is still current.
    pub(crate) fn is_current(&self, idx: u32, generation: u32) -> bool {
        self.slots
            .get(idx as usize)
            .is_some_and(|s| s.generation == generation && s.item.is_some())
    }

    /// Whether slot `idx` holds the volume of `incarnation`.
    pub(crate) fn is_incarnation(&self, idx: u32, incarnation: u32) -> bool {
        self.slots
            .get(idx as usize)
            .is_some_and(|s| s.incarnation == incarnation && s.item.is_some())
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.item.as_ref().map(|t| (i as u32, t)))
    }

    pub(crate) fn len(&self) -> usize {
        self.count
    }
}

/// Ready rings (FIFO per priority class) and a timer heap, with generation-tagged entries.
#[derive(Debug)]
pub(crate) struct Ready {
    rings: Vec<VecDeque<(u32, u32)>>,
    timers: BinaryHeap<Reverse<(u64, u32, u32)>>,
    /// Promotion timers `(at, slot, incarnation)`: they survive re-placement, so a volume
    /// re-placed after every dispatch keeps one pending promotion instead of pushing a new
    /// one; a timing wheel, as they are frequent and may fire slightly late.
    promotions: Wheel,
}

impl Ready {
    pub(crate) fn new(classes: usize) -> Self {
        Ready {
            rings: (0..classes).map(|_| VecDeque::new()).collect(),
            timers: BinaryHeap::new(),
            promotions: Wheel::default(),
        }
    }

    pub(crate) fn push_back(&mut self, class: usize, idx: u32, generation: u32) {
        if let Some(r) = self.rings.get_mut(class) {
            r.push_back((idx, generation));
        }
    }

    pub(crate) fn push_front(&mut self, class: usize, idx: u32, generation: u32) {
        if let Some(r) = self.rings.get_mut(class) {
            r.push_front((idx, generation));
        }
    }

    /// Front entry of a ring that is still current (stale entries are discarded).
    pub(crate) fn front_current<T>(&mut self, class: usize, slab: &Slab<T>) -> Option<u32> {
        let ring = self.rings.get_mut(class)?;
        while let Some(&(idx, generation)) = ring.front() {
            if slab.is_current(idx, generation) {
                return Some(idx);
            }
            ring.pop_front();
        }
        None
    }

    /// Appends every entry of ring `from` to ring `to`.
    pub(crate) fn merge(&mut self, from: usize, to: usize) {
        if from == to || from >= self.rings.len() || to >= self.rings.len() {
            return;
        }
        let mut moved = std::mem::take(&mut self.rings[from]);
        self.rings[to].append(&mut moved);
        // Keep the (now empty) buffer's allocation for reuse.
        self.rings[from] = moved;
    }

    /// Removes the front entry of a ring; returns it (`(slot, generation)`), so that a caller
    /// that passes a volume over can put the same placement back with [`Ready::push_front`].
    pub(crate) fn pop_front(&mut self, class: usize) -> Option<(u32, u32)> {
        self.rings.get_mut(class)?.pop_front()
    }

    pub(crate) fn timer(&mut self, at_ns: u64, idx: u32, generation: u32) {
        if at_ns != u64::MAX {
            self.timers.push(Reverse((at_ns, idx, generation)));
        }
    }

    /// Pops the next current timer due at or before `now_ns`.
    pub(crate) fn pop_due<T>(&mut self, now_ns: u64, slab: &Slab<T>) -> Option<u32> {
        while let Some(&Reverse((t, idx, generation))) = self.timers.peek() {
            if !slab.is_current(idx, generation) {
                self.timers.pop();
                continue;
            }
            if t > now_ns {
                return None;
            }
            self.timers.pop();
            return Some(idx);
        }
        None
    }

    /// Earliest current timer or promotion.
    pub(crate) fn next_timer<T>(&mut self, slab: &Slab<T>) -> Option<u64> {
        let mut next = None;
        while let Some(&Reverse((t, idx, generation))) = self.timers.peek() {
            if slab.is_current(idx, generation) {
                next = Some(t);
                break;
            }
            self.timers.pop();
        }
        match (next, self.promotions.next_fire()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub(crate) fn promotion(&mut self, at_ns: u64, idx: u32, incarnation: u32) {
        if at_ns != u64::MAX {
            self.promotions.push((at_ns, idx, incarnation));
        }
    }

    /// Pops a promotion that has fired by `now_ns` for a live volume: `(slot, at)`.
    pub(crate) fn pop_due_promotion<T>(
        &mut self,
        now_ns: u64,
        slab: &Slab<T>,
    ) -> Option<(u32, u64)> {
        while let Some((t, idx, inc)) = self.promotions.pop_due(now_ns) {
            if slab.is_incarnation(idx, inc) {
                return Some((idx, t));
            }
        }
        None
    }
}

/// Per-volume dispatch counters by phase.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PhaseStats {
    pub(crate) requests: [u64; 3],
    pub(crate) bytes: [u64; 3],
}

impl PhaseStats {
    pub(crate) fn record(&mut self, phase: Phase, bytes: u64) {
        let i = phase as usize;
        self.requests[i] += 1;
        self.bytes[i] = self.bytes[i].saturating_add(bytes);
    }
}

/// The common per-volume part of every policy.
///
/// `repr(C)`, hot fields first: an I/O reads the queue, the copies of the QoS fields it needs
/// (`io_unit_bytes`, `weight`, `burst_none`) and writes `stats`; the full `qos` (88 bytes) at
/// the end is read only on configuration changes (and by mClock's tags), so with thousands of
/// cache-cold volumes it does not cost a miss per I/O.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct VolCore {
    pub(crate) queue: VecDeque<IoRequest>,
    /// `qos.io_unit_bytes`.
    io_unit_bytes: u32,
    /// `qos.weight`.
    pub(crate) weight: u32,
    /// `qos.burst == BurstMode::None`.
    pub(crate) burst_none: bool,
    pub(crate) id: VolumeId,
    pub(crate) stats: PhaseStats,
    /// The volume's QoS; change it with [`VolCore::set_qos`], which keeps the copies above.
    pub(crate) qos: VolumeQos,
}

impl VolCore {
    pub(crate) fn new(id: VolumeId, qos: VolumeQos) -> Self {
        VolCore {
            queue: VecDeque::new(),
            io_unit_bytes: qos.io_unit_bytes,
            weight: qos.weight,
            burst_none: qos.burst == BurstMode::None,
            id,
            stats: PhaseStats::default(),
            qos,
        }
    }

    /// Applies a new QoS.
    pub(crate) fn set_qos(&mut self, qos: VolumeQos) {
        *self = VolCore {
            queue: std::mem::take(&mut self.queue),
            stats: self.stats,
            ..VolCore::new(self.id, qos)
        };
    }

    /// The charge of `req` under this volume's QoS (`Charge::of`, from the hot copy).
    pub(crate) fn charge(&self, req: &IoRequest) -> Charge {
        Charge::for_unit(self.io_unit_bytes, req)
    }

    pub(crate) fn snapshot(&self, credits: (Option<u64>, Option<u64>)) -> VolumeSnapshot {
        VolumeSnapshot {
            queued_requests: self.queue.len(),
            iops_credits: credits.0,
            bytes_credits: credits.1,
            dispatched_requests: self.stats.requests,
            dispatched_bytes: self.stats.bytes,
        }
    }
}
