//! A deterministic model of the RADOS lease protocol (crates/store/src/lease.rs), explored over
//! many seeded schedules of pauses, suspends, kills, clean restarts, slow networks and client
//! writes, with a checker in the manner of Jepsen: no acknowledged write is reverted, and no
//! node's commit applies after a newer owner's has (two owners at once).
//!
//! Why a model beside the real cluster tests: the races a lease has live in windows that a test
//! against a real cluster hits only by luck (a pause between two calls, an operation delayed
//! past a takeover). Here time, delivery and every node's steps are the explorer's, so hundreds
//! of schedules run in a second, every one replays from its seed, and each protection the
//! protocol has can be switched off to see the explorer find the race it closes.
//!
//! **What is modelled.** The cluster: the OSDs' clock; the exclusive locks on `lease` and on
//! `meta` (holder, expiry; an expired lock reads as free, as cls_lock's do; the raw state keeps
//! the last holder); the blocklist (entries with an expiry; every operation of a blocklisted
//! client is refused, lock calls included); a block's data (an extent object) and its metadata
//! (the commit). The network: an operation is applied when it arrives, usually within
//! milliseconds, sometimes hours later (librados resends after a partition or a pause). A node
//! incarnation: takes the lease (polling while it is held), fences the recorded previous holder,
//! takes the `meta` lock if the protocol has it, serves; a client write is a data operation and
//! then a commit, acknowledged when the commit is applied; it renews every third of a lease and
//! its watchdog looks every eighth, both on the node's own clock; a clean stop releases. Its
//! pauses: SIGSTOP (its clocks run on) and suspend (its monotonic clock stops; the boot clock
//! does not). What the protocol switches ([`Protocol`]) change is listed there; `Protocol::OLD`
//! is the protocol before docs/ARCHITECTURE.md decision 67, `Protocol::NEW` the one shipped.
//!
//! **What is not.** Lock calls are atomic and instant (they are one round trip to one OSD);
//! the OSD map is current at once after a blocklist add (the real node waits for it); no clock
//! skew between the OSDs; one write in flight per block per node (so a node never reorders
//! its own writes to a block, which NBD allows anyway).

use std::collections::{BTreeMap, HashMap};

const LEASE_MS: u64 = 30_000;
const HOUR_MS: u64 = 3_600_000;
const DAY_MS: u64 = 24 * HOUR_MS;
const BLOCKS: u64 = 4;

/// The protections a protocol has; each one closes a race the explorer finds without it.
#[derive(Clone, Copy, Debug)]
struct Protocol {
    /// A release refuses new operations, waits (up to half a lease) for those under way, and
    /// only then unlocks; without: unlock first, refuse after, nothing waited for.
    safe_release: bool,
    /// The lease's age is read on the boot clock (runs through a suspend); without: the
    /// monotonic clock.
    boot_clock: bool,
    /// The node sends no operation once the lease may have run out on its clock.
    expiry_check: bool,
    /// Commits carry an assertion of the node's lock on `meta`.
    commit_assert: bool,
    /// How long a fencing blocklist entry lasts.
    blocklist_ms: u64,
}

impl Protocol {
    const OLD: Protocol = Protocol {
        safe_release: false,
        boot_clock: false,
        expiry_check: false,
        commit_assert: false,
        blocklist_ms: HOUR_MS,
    };
    const NEW: Protocol = Protocol {
        safe_release: true,
        boot_clock: true,
        expiry_check: true,
        commit_assert: true,
        blocklist_ms: 30 * DAY_MS,
    };
}

/// A small deterministic generator (SplitMix64), so a schedule is its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

type Inc = u32;

#[derive(Clone, Copy, Debug)]
struct Lock {
    holder: Inc,
    expires_ms: u64,
}

#[derive(Default)]
struct Cluster {
    now_ms: u64,
    lease: Option<Lock>,
    /// The lease lock's raw state: its last holder, expired or not (lease.rs reads the xattr).
    lease_recorded: Option<Inc>,
    meta_lock: Option<Lock>,
    blocklist: HashMap<Inc, u64>,
    /// Per block: the write whose bytes the data object holds, and the one the metadata names.
    data: HashMap<u64, u64>,
    meta: HashMap<u64, u64>,
}

impl Cluster {
    fn holder(&self, lock: Option<Lock>) -> Option<Inc> {
        self.holder_at(lock, self.now_ms)
    }

    fn holder_at(&self, lock: Option<Lock>, at_ms: u64) -> Option<Inc> {
        lock.filter(|l| l.expires_ms > at_ms).map(|l| l.holder)
    }

    fn blocklisted(&self, inc: Inc) -> bool {
        self.blocklisted_at(inc, self.now_ms)
    }

    fn blocklisted_at(&self, inc: Inc, at_ms: u64) -> bool {
        self.blocklist.get(&inc).is_some_and(|&until| until > at_ms)
    }

    /// `rados_lock_exclusive`: taken (or renewed, `renew`: only while still held) by `inc`.
    fn lock(&mut self, meta: bool, inc: Inc, renew: bool) -> bool {
        if self.blocklisted(inc) {
            return false;
        }
        let current = if meta { self.meta_lock } else { self.lease };
        let ok = match self.holder(current) {
            Some(h) => h == inc,
            None => !renew,
        };
        if ok {
            let lock = Some(Lock {
                holder: inc,
                expires_ms: self.now_ms + LEASE_MS,
            });
            if meta {
                self.meta_lock = lock;
            } else {
                self.lease = lock;
                self.lease_recorded = Some(inc);
            }
        }
        ok
    }

    fn unlock(&mut self, meta: bool, inc: Inc) {
        if self.blocklisted(inc) {
            return;
        }
        let slot = if meta {
            &mut self.meta_lock
        } else {
            &mut self.lease
        };
        if slot.is_some_and(|l| l.holder == inc) {
            *slot = None;
            // An unlock rewrites the lock's state without the holder: nobody to fence next.
            if !meta {
                self.lease_recorded = None;
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Data,
    Commit,
}

/// An operation on its way to the OSD.
#[derive(Clone, Copy, Debug)]
struct Op {
    from: Inc,
    write: u64,
    block: u64,
    stage: Stage,
    assert_meta: bool,
    arrives_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Starting,
    Serving,
    Releasing { since_ms: u64 },
    Gone,
}

struct Node {
    inc: Inc,
    state: State,
    paused_until_ms: u64,
    /// Whether the pause under way stops the monotonic clock (a suspend, not a SIGSTOP).
    suspended: bool,
    /// Time the monotonic clock missed (suspends so far).
    mono_lost_ms: u64,
    /// Last successful renewal, on the clock the protocol ages the lease on.
    renewed_ms: u64,
    next_renew_ms: u64,
    next_watch_ms: u64,
    stopped_io: bool,
    /// Operations sent and not answered; completions it has not taken yet (paused).
    in_flight: u32,
    done: Vec<(Op, bool)>,
    /// Blocks with a write of this node in flight.
    busy: Vec<u64>,
}

impl Node {
    fn new(inc: Inc) -> Node {
        Node {
            inc,
            state: State::Starting,
            paused_until_ms: 0,
            suspended: false,
            mono_lost_ms: 0,
            renewed_ms: 0,
            next_renew_ms: 0,
            next_watch_ms: 0,
            stopped_io: false,
            in_flight: 0,
            done: Vec::new(),
            busy: Vec::new(),
        }
    }

    fn clock(&self, protocol: &Protocol, now_ms: u64) -> u64 {
        if protocol.boot_clock {
            now_ms
        } else {
            self.mono(now_ms)
        }
    }

    /// The node's monotonic clock: stopped while it was suspended.
    fn mono(&self, now_ms: u64) -> u64 {
        now_ms - self.mono_lost_ms
    }

    fn runs(&self, now_ms: u64) -> bool {
        now_ms >= self.paused_until_ms && self.state != State::Gone
    }
}

/// One acknowledged write.
#[derive(Clone, Copy, Debug)]
struct Ack {
    write: u64,
    issued_ms: u64,
}

#[derive(Default, Debug)]
struct Anomalies {
    /// A block's data, or its metadata, ends on a write issued before its last acknowledged one.
    data_reverted: u32,
    meta_reverted: u32,
    /// A commit of a node applied after a newer owner's first commit had.
    split_brain: u32,
}

impl Anomalies {
    fn any(&self) -> bool {
        self.data_reverted + self.meta_reverted + self.split_brain > 0
    }
}

/// What a schedule may do to the nodes and the network.
#[derive(Clone, Copy)]
struct Faults {
    /// Longest pause or suspend of a node.
    pause_max_ms: u64,
    /// Longest time an operation may take to arrive (a partition, a resend after a pause).
    delay_max_ms: u64,
}

struct World {
    protocol: Protocol,
    rng: Rng,
    cluster: Cluster,
    nodes: Vec<Node>,
    next_inc: Inc,
    network: Vec<Op>,
    next_write: u64,
    issued: HashMap<u64, u64>,
    /// Incarnations in the order their first commit applied.
    owners: Vec<Inc>,
    acks: BTreeMap<u64, Vec<Ack>>,
    anomalies: Anomalies,
    faults: Faults,
    /// Prints every step (`HEADROOM_LEASE_TRACE=SEED` replays that schedule so).
    trace: bool,
}

impl World {
    fn new(protocol: Protocol, seed: u64, faults: Faults) -> World {
        let mut world = World {
            protocol,
            rng: Rng(seed),
            cluster: Cluster::default(),
            nodes: Vec::new(),
            next_inc: 1,
            network: Vec::new(),
            next_write: 1,
            issued: HashMap::new(),
            owners: Vec::new(),
            acks: BTreeMap::new(),
            anomalies: Anomalies::default(),
            faults,
            trace: std::env::var("HEADROOM_LEASE_TRACE").is_ok_and(|s| s == seed.to_string()),
        };
        for _ in 0..2 {
            world.start_node();
        }
        world
    }

    fn start_node(&mut self) {
        let inc = self.next_inc;
        self.next_inc += 1;
        self.nodes.push(Node::new(inc));
    }

    fn send(&mut self, node: usize, write: u64, block: u64, stage: Stage) {
        let delay = if self.rng.chance(20) {
            self.rng.below(self.faults.delay_max_ms)
        } else {
            1 + self.rng.below(20)
        };
        if self.trace {
            eprintln!(
                "{} send inc {} write {write} block {block} {stage:?} arrives +{delay}",
                self.cluster.now_ms, self.nodes[node].inc
            );
        }
        let n = &mut self.nodes[node];
        n.in_flight += 1;
        self.network.push(Op {
            from: n.inc,
            write,
            block,
            stage,
            assert_meta: self.protocol.commit_assert,
            arrives_ms: self.cluster.now_ms + delay,
        });
    }

    /// Whether node `i` may send an operation now (its own checks; the OSD has its own).
    fn may_send(&self, i: usize) -> bool {
        let n = &self.nodes[i];
        let now = n.clock(&self.protocol, self.cluster.now_ms);
        !n.stopped_io && (!self.protocol.expiry_check || now < n.renewed_ms + LEASE_MS)
    }

    /// Applies the operations that have arrived, in the order and against the cluster's state
    /// at the moment each arrived (locks and the blocklist change only at steps, but expire
    /// in between); answers go to their nodes.
    fn deliver(&mut self) {
        let now = self.cluster.now_ms;
        let (mut arrived, waiting): (Vec<Op>, Vec<Op>) =
            self.network.drain(..).partition(|op| op.arrives_ms <= now);
        self.network = waiting;
        arrived.sort_by_key(|op| op.arrives_ms);
        for op in arrived {
            let at = op.arrives_ms;
            let blocklisted = self.cluster.blocklisted_at(op.from, at);
            if self.trace {
                eprintln!("{now} deliver {op:?} blocklisted={blocklisted}");
            }
            let refused = blocklisted
                || (op.stage == Stage::Commit
                    && op.assert_meta
                    && self.cluster.holder_at(self.cluster.meta_lock, at) != Some(op.from));
            if !refused {
                match op.stage {
                    Stage::Data => self.cluster.data.insert(op.block, op.write),
                    Stage::Commit => self.cluster.meta.insert(op.block, op.write),
                };
                // The store's owners in the order their first commit applied: a commit of
                // an older one after a newer one's means two nodes wrote the store at once.
                if op.stage == Stage::Commit {
                    if !self.owners.contains(&op.from) {
                        self.owners.push(op.from);
                    }
                    if self.owners.last() != Some(&op.from) {
                        self.anomalies.split_brain += 1;
                    }
                }
            }
            if let Some(n) = self.nodes.iter_mut().find(|n| n.inc == op.from) {
                n.done.push((op, !refused));
            }
        }
    }

    fn lose(&mut self, i: usize) {
        if self.trace {
            eprintln!("{} lose inc {}", self.cluster.now_ms, self.nodes[i].inc);
        }
        // It stops serving and exits (lease.rs; status 3): a supervisor starts another.
        let n = &mut self.nodes[i];
        n.stopped_io = true;
        n.state = State::Gone;
    }

    /// Node `i` takes its steps at the cluster's present time.
    fn step(&mut self, i: usize) {
        let now_ms = self.cluster.now_ms;
        if !self.nodes[i].runs(now_ms) {
            return;
        }
        let protocol = self.protocol;
        // Completions first.
        let done = std::mem::take(&mut self.nodes[i].done);
        for (op, ok) in done {
            self.nodes[i].in_flight -= 1;
            let alive = matches!(
                self.nodes[i].state,
                State::Serving | State::Releasing { .. }
            );
            match (op.stage, ok) {
                (Stage::Data, true) if alive && self.may_send(i) => {
                    self.send(i, op.write, op.block, Stage::Commit);
                    continue;
                }
                (Stage::Commit, true) => self.acknowledge(op),
                _ => {}
            }
            self.nodes[i].busy.retain(|&b| b != op.block);
        }
        let inc = self.nodes[i].inc;
        match self.nodes[i].state {
            State::Starting => {
                let previous = self.cluster.lease_recorded;
                if self.cluster.lock(false, inc, false) {
                    if self.trace {
                        eprintln!("{now_ms} inc {inc} takes the lease, fences {previous:?}");
                    }
                    if let Some(p) = previous.filter(|&p| p != inc) {
                        self.cluster
                            .blocklist
                            .insert(p, now_ms + protocol.blocklist_ms);
                    }
                    if protocol.commit_assert {
                        // Holding the lease, having fenced: any other holder is broken.
                        self.cluster.meta_lock = None;
                        self.cluster.lock(true, inc, false);
                    }
                    let n = &mut self.nodes[i];
                    let (clock, mono) = (n.clock(&protocol, now_ms), n.mono(now_ms));
                    n.renewed_ms = clock;
                    n.next_renew_ms = mono + LEASE_MS / 3;
                    n.next_watch_ms = mono + LEASE_MS / 8;
                    n.state = State::Serving;
                }
            }
            State::Serving | State::Releasing { .. } => {
                // The threads sleep on the monotonic clock (a condition variable's timeout),
                // so after a suspend they wake only when its remaining time has passed; the
                // lease's age is read on the protocol's clock.
                let clock = self.nodes[i].clock(&protocol, now_ms);
                let mono = self.nodes[i].mono(now_ms);
                if mono >= self.nodes[i].next_watch_ms {
                    self.nodes[i].next_watch_ms = mono + LEASE_MS / 8;
                    if clock >= self.nodes[i].renewed_ms + LEASE_MS {
                        return self.lose(i);
                    }
                }
                if mono >= self.nodes[i].next_renew_ms {
                    if protocol.boot_clock && clock >= self.nodes[i].renewed_ms + LEASE_MS {
                        return self.lose(i);
                    }
                    let renewed = self.cluster.lock(false, inc, true)
                        && (!protocol.commit_assert || self.cluster.lock(true, inc, true));
                    if !renewed {
                        return self.lose(i);
                    }
                    let n = &mut self.nodes[i];
                    n.renewed_ms = clock;
                    n.next_renew_ms = mono + LEASE_MS / 3;
                }
                if let State::Releasing { since_ms } = self.nodes[i].state {
                    let drained = self.nodes[i].in_flight == 0;
                    if drained || now_ms >= since_ms + LEASE_MS / 2 {
                        if drained {
                            self.cluster.unlock(true, inc);
                            self.cluster.unlock(false, inc);
                        }
                        self.nodes[i].state = State::Gone;
                    }
                }
            }
            State::Gone => {}
        }
    }

    fn acknowledge(&mut self, op: Op) {
        if self.trace {
            eprintln!(
                "{} ack write {} block {}",
                self.cluster.now_ms, op.write, op.block
            );
        }
        self.acks.entry(op.block).or_default().push(Ack {
            write: op.write,
            issued_ms: self.issued[&op.write],
        });
    }

    /// A client writes a block through node `i`, if it serves and has no write to it in flight.
    fn client_write(&mut self, i: usize) {
        let block = self.rng.below(BLOCKS);
        let n = &self.nodes[i];
        if n.state != State::Serving || n.busy.contains(&block) || !n.runs(self.cluster.now_ms) {
            return;
        }
        if !self.may_send(i) {
            return;
        }
        let write = self.next_write;
        self.next_write += 1;
        self.issued.insert(write, self.cluster.now_ms);
        self.nodes[i].busy.push(block);
        self.send(i, write, block, Stage::Data);
    }

    fn release(&mut self, i: usize) {
        let now_ms = self.cluster.now_ms;
        if self.trace {
            eprintln!("{now_ms} release inc {}", self.nodes[i].inc);
        }
        let inc = self.nodes[i].inc;
        if self.nodes[i].state != State::Serving || !self.nodes[i].runs(now_ms) {
            return;
        }
        self.nodes[i].stopped_io = true;
        if self.protocol.safe_release {
            self.nodes[i].state = State::Releasing { since_ms: now_ms };
        } else {
            self.cluster.unlock(false, inc);
            self.nodes[i].state = State::Gone;
        }
    }

    fn pause(&mut self, i: usize, suspend: bool) {
        let now_ms = self.cluster.now_ms;
        let n = &mut self.nodes[i];
        if !n.runs(now_ms) {
            return;
        }
        let length = 1 + self.rng.below(self.faults.pause_max_ms);
        if self.trace {
            eprintln!(
                "{now_ms} pause inc {} for {length} suspend={suspend}",
                n.inc
            );
        }
        n.paused_until_ms = now_ms + length;
        n.suspended = suspend;
        if suspend {
            n.mono_lost_ms += length;
        }
    }

    /// One random schedule of `events` events, then every operation delivered; the checks.
    fn run(mut self, events: u32) -> Anomalies {
        for _ in 0..events {
            // Another process comes up when fewer than two run (a supervisor's restart), and
            // now and then a third.
            let running = self.nodes.iter().filter(|n| n.state != State::Gone).count();
            if running < 2 || (running < 3 && self.rng.chance(5)) {
                self.start_node();
            }
            let live: Vec<usize> = (0..self.nodes.len())
                .filter(|&i| self.nodes[i].state != State::Gone)
                .collect();
            let pick = live[self.rng.below(live.len() as u64) as usize];
            match self.rng.below(1000) {
                0..=699 => self.client_write(pick),
                700..=719 => self.pause(pick, false),
                720..=739 => self.pause(pick, true),
                740..=749 => self.nodes[pick].state = State::Gone,
                750..=759 => self.release(pick),
                // Time passes until the first paused node wakes (a long suspend ends).
                760..=769 => {
                    let now = self.cluster.now_ms;
                    if let Some(t) = self
                        .nodes
                        .iter()
                        .map(|n| n.paused_until_ms)
                        .filter(|&t| t > now)
                        .min()
                    {
                        self.cluster.now_ms = t;
                    }
                }
                _ => {}
            }
            let advance = if self.rng.chance(30) {
                self.rng.below(LEASE_MS * 2)
            } else {
                self.rng.below(50)
            };
            self.cluster.now_ms += advance;
            self.deliver();
            for i in 0..self.nodes.len() {
                self.step(i);
            }
        }
        // Everything still on its way arrives (nodes keep taking steps meanwhile).
        while let Some(next) = self.network.iter().map(|op| op.arrives_ms).min() {
            self.cluster.now_ms = self.cluster.now_ms.max(next);
            self.deliver();
            for i in 0..self.nodes.len() {
                self.step(i);
            }
        }
        for (block, acks) in &self.acks {
            let last = acks[acks.len() - 1];
            let older = |write: Option<&u64>| {
                write.is_some_and(|w| *w != last.write && self.issued[w] < last.issued_ms)
            };
            if older(self.cluster.data.get(block)) {
                self.anomalies.data_reverted += 1;
            }
            if older(self.cluster.meta.get(block)) {
                self.anomalies.meta_reverted += 1;
            }
        }
        self.anomalies
    }
}

/// Within the blocklist: pauses and network delays up to three hours (past the old hour).
const WITHIN_BLOCKLIST: Faults = Faults {
    pause_max_ms: 3 * HOUR_MS,
    delay_max_ms: 3 * HOUR_MS,
};

/// The schedules of `seeds` that show an anomaly, with what they show (printed: how many).
fn explore(
    protocol: Protocol,
    faults: Faults,
    seeds: std::ops::Range<u64>,
) -> Vec<(u64, Anomalies)> {
    let count = seeds.end - seeds.start;
    let found: Vec<(u64, Anomalies)> = seeds
        .filter_map(|seed| {
            let found = World::new(protocol, seed, faults).run(400);
            found.any().then_some((seed, found))
        })
        .collect();
    let sum = |f: fn(&Anomalies) -> u32| found.iter().map(|(_, a)| f(a)).sum::<u32>();
    eprintln!(
        "{protocol:?}: {} of {count} schedules with anomalies (data reverted {}, metadata \
         reverted {}, two owners committing {})",
        found.len(),
        sum(|a| a.data_reverted),
        sum(|a| a.meta_reverted),
        sum(|a| a.split_brain)
    );
    found
}

/// How many schedules a CI run explores per case (a long run: `HEADROOM_LEASE_SCHEDULES`).
fn schedules() -> u64 {
    std::env::var("HEADROOM_LEASE_SCHEDULES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300)
}

#[test]
fn the_shipped_protocol_loses_no_acknowledged_write_in_any_schedule() {
    let found = explore(Protocol::NEW, WITHIN_BLOCKLIST, 0..schedules());
    assert!(found.is_empty(), "anomalies (seed, what): {found:?}");
}

#[test]
fn the_old_protocol_loses_acknowledged_writes() {
    let found = explore(Protocol::OLD, WITHIN_BLOCKLIST, 0..schedules());
    assert!(
        !found.is_empty(),
        "the explorer found nothing on the old protocol"
    );
}

/// Asserts that without one protection (`protocol`), some of four times the CI's schedules
/// under `faults` end with reverted data: the race that protection closes.
fn data_lost_without(protocol: Protocol, faults: Faults, what: &str) {
    let found = explore(protocol, faults, 0..schedules() * 4);
    assert!(
        found.iter().any(|(_, a)| a.data_reverted > 0),
        "nothing lost without {what}: {found:?}"
    );
}

/// Suspends longer than the blocklist (a VM suspended for weeks), operations arriving within
/// hours: the node must notice on resume that its lease is long gone, on the boot clock, and
/// send nothing before its watchdog looks.
const LONG_SUSPENDS: Faults = Faults {
    pause_max_ms: 60 * DAY_MS,
    delay_max_ms: 3 * HOUR_MS,
};

// Each protection is needed: without it alone, the explorer finds the race it closes.

#[test]
fn without_a_safe_release_a_late_write_of_the_released_node_lands() {
    let protocol = Protocol {
        safe_release: false,
        ..Protocol::NEW
    };
    data_lost_without(protocol, WITHIN_BLOCKLIST, "the safe release");
}

#[test]
fn with_the_blocklist_of_an_hour_a_node_paused_longer_lands_its_writes() {
    let protocol = Protocol {
        blocklist_ms: HOUR_MS,
        ..Protocol::NEW
    };
    data_lost_without(protocol, WITHIN_BLOCKLIST, "a 30-day blocklist");
}

#[test]
fn after_a_suspend_past_the_blocklist_the_shipped_protocol_still_loses_nothing() {
    let found = explore(Protocol::NEW, LONG_SUSPENDS, 0..schedules());
    assert!(found.is_empty(), "anomalies (seed, what): {found:?}");
}

#[test]
fn without_the_boot_clock_a_resumed_node_writes_over_its_successor() {
    let protocol = Protocol {
        boot_clock: false,
        ..Protocol::NEW
    };
    data_lost_without(protocol, LONG_SUSPENDS, "the boot clock");
}

#[test]
fn without_the_expiry_check_a_resumed_node_writes_before_its_watchdog_looks() {
    let protocol = Protocol {
        expiry_check: false,
        ..Protocol::NEW
    };
    data_lost_without(protocol, LONG_SUSPENDS, "the expiry check");
}

/// Past every blocklist (an operation that arrives months late), the metadata still holds:
/// the commit's lock assertion is checked by the OSD against the lock itself. The data of
/// such a write is the residual risk the blocklist's length bounds (docs/reliability.md).
#[test]
fn past_the_blocklist_the_lock_assertion_still_keeps_the_metadata() {
    let beyond = Faults {
        pause_max_ms: 3 * HOUR_MS,
        delay_max_ms: 60 * DAY_MS,
    };
    let shipped = explore(Protocol::NEW, beyond, 0..schedules());
    assert!(
        shipped
            .iter()
            .all(|(_, a)| a.meta_reverted == 0 && a.split_brain == 0),
        "metadata reverted or two owners committing with the lock assertion: {shipped:?}"
    );
    let without = Protocol {
        commit_assert: false,
        ..Protocol::NEW
    };
    let found = explore(without, beyond, 0..schedules() * 4);
    assert!(
        found.iter().any(|(_, a)| a.meta_reverted > 0),
        "no reverted metadata without the assertion: {found:?}"
    );
}
