//! Crash consistency: a writer drives the real `headroom serve` (file
//! backend) over NBD and the management API while the server is killed with SIGKILL at a
//! random moment; the server is restarted on the same data directory and everything the writer
//! was promised is checked.
//!
//! The writer keeps a model of every 4 KiB block of every volume: the contents that are
//! *durable* (written by a request acknowledged with FUA, or acknowledged before a FLUSH on the
//! same export was sent and that FLUSH was acknowledged) and every later content that *may* be
//! there (acknowledged or in flight, not yet durable). Requests are pipelined (up to 16 per
//! connection, one connection per volume) and never overlap one another while in flight, so the
//! versions of a block are totally ordered. The mix: WRITE (often to extents never written, so
//! extents get allocated), FUA WRITE, FLUSH, TRIM and WRITE_ZEROES (with and without NO_HOLE and
//! FUA, partial and whole extents, which releases them), and volume create, resize (grow and
//! shrink) and delete through the API.
//!
//! After each kill the restarted server must come up (ports open), list exactly the volumes it
//! must (an acknowledged create exists, an acknowledged delete stays deleted, an unacknowledged
//! one may go either way) with their acknowledged size, and every block of every volume must
//! hold its durable contents or a later possible one: never older data, never zeros where data
//! was durable, never another block's or another volume's data. What the restarted server
//! serves then becomes the block's only allowed content (a process kill keeps the page cache,
//! so nothing may change without a write).
//!
//! Every other volume has two replicas (one copy on each device): its data is checked the
//! same way through NBD, and at the end the stopped server's store is opened directly and the
//! two copies of every allocated extent of those volumes are compared (they must agree: the
//! resync of each unclean start made them equal, and every later write went to both).
//!
//! `HEADROOM_CRASH_CYCLES` (default 100) sets the number of kill/restart cycles and
//! `HEADROOM_CRASH_SEED` replays a run's choices (the kill moments are wall-clock delays, so a
//! replay repeats the operations, not the exact interleaving). `scripts/crash-loop` runs this
//! test for long runs.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code panics on failure by design

mod common;
mod crash;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use common::Server;
use crash::{BLOCK, Conn, Found, Patterns, Rng};
use headroom_nbd::consts::{
    NBD_CMD_FLAG_FUA, NBD_CMD_FLAG_NO_HOLE, NBD_CMD_FLUSH, NBD_CMD_TRIM, NBD_CMD_WRITE,
    NBD_CMD_WRITE_ZEROES, NBD_EIO,
};
use serde_json::{Value, json};

const EXTENT: u64 = 2 << 20;
const MIB: u64 = 1 << 20;
const SERVER_ARGS: &[&str] = &["--devices", "2", "--device-size", "1GiB"];
const MAX_VOLUMES: usize = 4;
/// Requests in flight per connection.
const WINDOW: usize = 16;
/// Tags name block versions: 0 is "never written" (zeros); otherwise `op << 1 | zero`.
const ZERO_BIT: u64 = 1;
/// Range of the random delay between the start of the I/O and the SIGKILL.
const KILL_DELAY_MS: (u64, u64) = (5, 400);
/// Share of cycles whose kill is aimed at one kind of request.
const TARGETED_PERCENT: u64 = 50;

fn is_zero_tag(tag: u64) -> bool {
    tag == 0 || tag & ZERO_BIT != 0
}

/// Why the writer stopped: the connection or the API broke (expected once the kill landed).
struct Broken(String);

impl From<std::io::Error> for Broken {
    fn from(err: std::io::Error) -> Self {
        Broken(format!("nbd: {err}"))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Presence {
    Exists,
    /// Create sent, not acknowledged.
    MaybeCreated,
    /// Delete sent, not acknowledged.
    MaybeDeleted,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Write,
    FuaWrite,
    AllocatingWrite,
    Flush,
    Trim,
    WriteZeroes,
    Create,
    Resize,
    Delete,
    /// `POST /v1/devices`: a new device file joins the pool.
    DeviceAdd,
    /// `POST /v1/volumes/{name}/scrub` of a replicated volume (its copies must agree).
    Scrub,
    /// `POST /v1/devices/{id}/fail`: the operator fails a device (at most one per run); the
    /// rebuild task then copies the replicated volumes' lost copies elsewhere.
    DeviceFail,
}

/// How a cycle ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum End {
    /// SIGKILL at a random moment.
    Kill,
    /// SIGTERM at a random moment: the server must flush and exit 0, after which every
    /// acknowledged write is durable.
    Term,
    /// SIGTERM, then SIGKILL 0-20 ms later (a kill during the clean shutdown).
    TermThenKill,
}

/// What a run drives: the file backend (replicated volumes, device adds, scrubs) or RADOS
/// (one copy, Ceph keeps the replicas; the pool has one device).
struct Setup {
    server_args: Vec<String>,
    /// Every other volume has two replicas.
    replicated: bool,
    /// Device adds and scrubs are part of the mix.
    device_ops: bool,
}

struct Op {
    kind: Kind,
    first: u64,
    count: u64,
    tag: u64,
    fua: bool,
    /// For FLUSH: the writes acknowledged before it was sent, (first block, count, tag).
    covers: Vec<(u64, u64, u64)>,
    allocating: bool,
}

struct Vol {
    uid: u64,
    name: String,
    size: u64,
    /// Sizes it may have after a crash (more than one while a resize is unacknowledged).
    sizes: Vec<u64>,
    presence: Presence,
    /// Per block: `[durable, later possible...]`.
    blocks: Vec<Vec<u64>>,
    /// Per block: a request touching it is in flight.
    busy: Vec<bool>,
    /// Per extent: may be unallocated (a write there allocates).
    maybe_hole: Vec<bool>,
    /// Writes acknowledged since the last FLUSH on this export was sent.
    acked_unflushed: Vec<(u64, u64, u64)>,
    conn: Option<Conn>,
    inflight: HashMap<u64, Op>,
}

impl Vol {
    fn new(uid: u64, size: u64, presence: Presence) -> Vol {
        let blocks = (size / BLOCK) as usize;
        Vol {
            uid,
            name: format!("crash{uid}"),
            size,
            sizes: vec![size],
            presence,
            blocks: vec![vec![0]; blocks],
            busy: vec![false; blocks],
            maybe_hole: vec![true; size.div_ceil(EXTENT) as usize],
            acked_unflushed: Vec::new(),
            conn: None,
            inflight: HashMap::new(),
        }
    }

    fn block_count(&self) -> u64 {
        self.size / BLOCK
    }

    /// The content tagged `tag` became durable for these blocks: older versions can no longer
    /// come back.
    fn make_durable(&mut self, first: u64, count: u64, tag: u64) {
        for b in first..first + count {
            if let Some(history) = self.blocks.get_mut(b as usize)
                && let Some(pos) = history.iter().position(|&t| t == tag)
            {
                history.drain(..pos);
            }
        }
    }

    /// Sets the model to `blocks` blocks (a shrink forgets, a grow adds durable zeros).
    fn set_blocks(&mut self, blocks: u64) {
        let blocks = blocks as usize;
        self.blocks.resize(blocks, vec![0]);
        self.busy.resize(blocks, false);
        self.maybe_hole
            .resize((blocks as u64 * BLOCK).div_ceil(EXTENT) as usize, true);
    }
}

#[derive(Default)]
struct Stats {
    sent: BTreeMap<Kind, u64>,
    acked: BTreeMap<Kind, u64>,
    /// Cycles in which the kill landed while a request of this kind was in flight.
    killed_during: BTreeMap<Kind, u64>,
    blocks_checked: u64,
    durable_data_blocks_checked: u64,
    ambiguous_blocks_checked: u64,
    volumes_checked: u64,
    /// What became of management calls cut by the kill.
    outcomes: BTreeMap<&'static str, u64>,
    /// How the cycles ended (by the signal sent) and how the server left (exit 0 or killed).
    ends: BTreeMap<&'static str, u64>,
    /// Servers killed while starting (recovery after the previous crash), and of those how
    /// many before they printed their addresses (still recovering or starting).
    early_kills: u64,
    early_kills_before_ready: u64,
    /// Of those, kills after the startup punch was logged (in the replica resync, the open
    /// commit or the node's start).
    early_kills_after_punch: u64,
    /// Scrubs that compared copies (every one found them equal).
    scrubs: u64,
    /// Acknowledged, unflushed writes that a clean shutdown made durable (checked as such).
    writes_durable_by_shutdown: u64,
    /// FLUSH and FUA requests of 1-replica volumes refused with EIO because a device they
    /// have an extent on was failed.
    durability_refused: u64,
}

struct Harness {
    /// The servers' log (every restart appends to it), for failures found off the API.
    server_log: Option<std::path::PathBuf>,
    rng: Rng,
    seed: u64,
    cycle: u64,
    patterns: Patterns,
    vols: Vec<Vol>,
    /// Names whose delete was acknowledged, or whose unacknowledged create did not survive.
    gone: BTreeSet<String>,
    next_uid: u64,
    next_op: u64,
    next_cookie: u64,
    /// Management call in flight (for the statistics).
    mgmt_inflight: Option<Kind>,
    /// Targeted cycles: after `steps_before_target` steps, the next request of this kind
    /// sends the killer a short fuse (0-3 ms) instead of waiting for its timer.
    target: Option<Kind>,
    steps_before_target: u64,
    fuse: Option<mpsc::Sender<Duration>>,
    /// What each tag was, for failure messages.
    log: HashMap<u64, String>,
    stats: Stats,
    replicated: bool,
    device_ops: bool,
    /// Devices the pool has for sure (acknowledged adds included), and adds cut by a crash
    /// whose outcome a restart has not shown yet.
    devices: u64,
    devices_maybe: u64,
    /// The device the operator failed (acknowledged, or seen failed after a restart), and
    /// one whose fail was cut by a crash.
    failed_device: Option<u64>,
    fail_maybe: Option<u64>,
}

/// Most devices the harness grows the pool to (device files of 1 GiB, sparse).
const MAX_DEVICES: u64 = 10;

struct Api {
    base: String,
    agent: ureq::Agent,
}

impl Api {
    fn new(base: &str) -> Api {
        let agent = common::agent();
        Api {
            base: base.trim_end_matches('/').to_string(),
            agent,
        }
    }

    /// Sends a request; a transport error is `Broken`, a non-2xx status a test failure.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, Broken> {
        let url = format!("{}{path}", self.base);
        let result = match (method, body) {
            ("GET", _) => self
                .agent
                .get(&url)
                .header("authorization", common::bearer())
                .call(),
            ("DELETE", _) => self
                .agent
                .delete(&url)
                .header("authorization", common::bearer())
                .call(),
            ("POST", Some(b)) => self
                .agent
                .post(&url)
                .header("authorization", common::bearer())
                .send_json(&b),
            ("PATCH", Some(b)) => self
                .agent
                .patch(&url)
                .header("authorization", common::bearer())
                .send_json(&b),
            _ => panic!("bad API call {method} {path}"),
        };
        let mut response = result.map_err(|e| Broken(format!("api {method} {path}: {e}")))?;
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| Broken(format!("api {method} {path} body: {e}")))?;
        assert!(
            (200..300).contains(&status),
            "API {method} {path} answered {status}: {text}"
        );
        if text.trim().is_empty() {
            return Ok(Value::Null);
        }
        Ok(serde_json::from_str(&text).expect("API answers JSON"))
    }
}

impl Harness {
    fn new(seed: u64, setup: &Setup) -> Harness {
        Harness {
            replicated: setup.replicated,
            device_ops: setup.device_ops,
            devices: if setup.device_ops { 2 } else { 1 },
            devices_maybe: 0,
            failed_device: None,
            fail_maybe: None,
            rng: Rng::new(seed),
            seed,
            cycle: 0,
            patterns: Patterns::new(),
            vols: Vec::new(),
            gone: BTreeSet::new(),
            next_uid: 1,
            next_op: 1,
            next_cookie: 1,
            mgmt_inflight: None,
            target: None,
            steps_before_target: 0,
            fuse: None,
            log: HashMap::new(),
            stats: Stats::default(),
            server_log: None,
        }
    }

    fn fail(&self, server: &Server, what: &str) -> ! {
        self.fail_with_log(&server.log_path, what)
    }

    fn fail_with_log(&self, log_path: &std::path::Path, what: &str) -> ! {
        let log = std::fs::read_to_string(log_path).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(60).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        // A replay need not fail again (timing is not in the seed): whatever the server
        // warned of, anywhere in its log, comes with the failure.
        let warned: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .take(40)
            .collect();
        panic!(
            "crash consistency FAILED at cycle {} (seed {}; replay: HEADROOM_CRASH_SEED={} \
             HEADROOM_CRASH_CYCLES={}): {what}\nserver log (warnings and errors):\n{}\nserver \
             log (last lines):\n{}",
            self.cycle,
            self.seed,
            self.seed,
            self.cycle + 1,
            warned.join("\n"),
            tail.join("\n")
        );
    }

    fn random_size(&mut self) -> u64 {
        // Mostly whole extents, sometimes ending inside one (the shrink punches a partial tail).
        let extents = self.rng.range(4, 32);
        let extra = if self.rng.chance(30) {
            self.rng.range(1, EXTENT / BLOCK - 1) * BLOCK
        } else {
            0
        };
        extents * EXTENT - if extra > 0 { EXTENT - extra } else { 0 }
    }

    /// In a targeted cycle, lights the killer's short fuse just before a request of `kind`.
    fn arm(&mut self, kind: Kind) {
        if self.target == Some(kind)
            && self.steps_before_target == 0
            && let Some(fuse) = self.fuse.take()
        {
            let delay = Duration::from_micros(self.rng.range(0, 3000));
            let _ = fuse.send(delay);
            self.target = None;
        }
    }

    fn tag(&mut self, zero: bool) -> u64 {
        let op = self.next_op;
        self.next_op += 1;
        (op << 1) | u64::from(zero)
    }

    fn cookie(&mut self) -> u64 {
        self.next_cookie += 1;
        self.next_cookie
    }

    fn live(&self) -> Vec<usize> {
        (0..self.vols.len())
            .filter(|&i| self.vols[i].conn.is_some())
            .collect()
    }

    // ----- the writer ---------------------------------------------------------------------

    fn step(&mut self, api: &Api, server: &Server) -> Result<(), Broken> {
        let live = self.live();
        if live.is_empty() {
            return self.create(api, server);
        }
        let v = live[self.rng.range(0, live.len() as u64 - 1) as usize];
        if let Some(target) = self.target {
            if self.steps_before_target > 0 {
                self.steps_before_target -= 1;
            } else if self.vols[v].inflight.is_empty()
                || (self.vols[v].inflight.len() < WINDOW && self.rng.chance(50))
            {
                // A targeted cycle: do the target now (`arm` lights the short fuse). Half the
                // time the step falls through instead, so replies keep being read and a
                // target that cannot be placed yet never spins without touching the network.
                return match target {
                    Kind::Create => {
                        if self.vols.len() >= MAX_VOLUMES {
                            self.delete(v, api)
                        } else {
                            self.create(api, server)
                        }
                    }
                    Kind::Resize => self.resize(v, api, server),
                    Kind::Delete => {
                        if self.live().len() < 2 {
                            self.create(api, server)
                        } else {
                            self.delete(v, api)
                        }
                    }
                    Kind::Flush => self.flush(v),
                    // A target that cannot be placed (the pool at its most devices, a device
                    // failed already, a volume with one copy) is dropped: the kill comes on
                    // the timer, and the writer does not spin without touching the network.
                    Kind::DeviceAdd if self.devices + self.devices_maybe < MAX_DEVICES => {
                        self.add_device(api)
                    }
                    Kind::DeviceFail
                        if self.failed_device.is_none()
                            && self.fail_maybe.is_none()
                            && self.devices >= 3 =>
                    {
                        self.fail_device(api)
                    }
                    Kind::Scrub if self.replicated && self.vols[v].uid % 2 == 1 => {
                        self.scrub(v, api, server)
                    }
                    Kind::DeviceAdd | Kind::DeviceFail | Kind::Scrub => {
                        self.target = None;
                        self.write(v)
                    }
                    Kind::Trim => self.discard(v, NBD_CMD_TRIM),
                    Kind::WriteZeroes => self.discard(v, NBD_CMD_WRITE_ZEROES),
                    _ => self.write(v),
                };
            }
        }
        let inflight = self.vols[v].inflight.len();
        let roll = self.rng.range(0, 99);
        if inflight >= WINDOW || (inflight > 0 && roll < 35) {
            return self.receive(v);
        }
        match self.rng.range(0, 999) {
            0..=619 => self.write(v),
            620..=739 => self.flush(v),
            740..=849 => self.discard(v, NBD_CMD_TRIM),
            850..=964 => self.discard(v, NBD_CMD_WRITE_ZEROES),
            965..=974 => self.create(api, server),
            975..=984 => self.resize(v, api, server),
            985..=994 => self.delete(v, api),
            995..=996 if self.device_ops => self.add_device(api),
            997..=998 if self.device_ops => self.scrub(v, api, server),
            999 if self.device_ops => self.fail_device(api),
            _ => self.write(v),
        }
    }

    /// Adds a device file to the pool (at most `MAX_DEVICES`).
    fn add_device(&mut self, api: &Api) -> Result<(), Broken> {
        if self.devices + self.devices_maybe >= MAX_DEVICES {
            return Ok(());
        }
        self.mgmt_inflight = Some(Kind::DeviceAdd);
        self.devices_maybe += 1;
        *self.stats.sent.entry(Kind::DeviceAdd).or_default() += 1;
        self.arm(Kind::DeviceAdd);
        api.call(
            "POST",
            "/v1/devices",
            Some(json!({"size_bytes": 1u64 << 30})),
        )?;
        self.mgmt_inflight = None;
        self.devices_maybe -= 1;
        self.devices += 1;
        *self.stats.acked.entry(Kind::DeviceAdd).or_default() += 1;
        Ok(())
    }

    /// Fails a device through the API, once per run and only with at least three devices (so
    /// two healthy ones remain for new copies and for the rebuild's).
    fn fail_device(&mut self, api: &Api) -> Result<(), Broken> {
        if self.failed_device.is_some() || self.fail_maybe.is_some() || self.devices < 3 {
            return Ok(());
        }
        let id = self.rng.range(0, self.devices - 1);
        self.mgmt_inflight = Some(Kind::DeviceFail);
        self.fail_maybe = Some(id);
        *self.stats.sent.entry(Kind::DeviceFail).or_default() += 1;
        self.arm(Kind::DeviceFail);
        api.call("POST", &format!("/v1/devices/{id}/fail"), Some(json!({})))?;
        self.mgmt_inflight = None;
        self.fail_maybe = None;
        self.failed_device = Some(id);
        *self.stats.acked.entry(Kind::DeviceFail).or_default() += 1;
        Ok(())
    }

    /// Scrubs volume `v` if it is replicated: its copies must agree (every write reaches
    /// both before its reply, and each unclean start resynchronised them).
    fn scrub(&mut self, v: usize, api: &Api, server: &Server) -> Result<(), Broken> {
        if self.vols[v].uid.is_multiple_of(2) || !self.replicated {
            return Ok(());
        }
        let name = self.vols[v].name.clone();
        self.mgmt_inflight = Some(Kind::Scrub);
        *self.stats.sent.entry(Kind::Scrub).or_default() += 1;
        self.arm(Kind::Scrub);
        let report = api.call(
            "POST",
            &format!("/v1/volumes/{name}/scrub"),
            Some(json!({})),
        )?;
        self.mgmt_inflight = None;
        *self.stats.acked.entry(Kind::Scrub).or_default() += 1;
        if report["mismatches"].as_u64() != Some(0) {
            self.fail(
                server,
                &format!("scrub of {name} found copies that differ: {report}"),
            );
        }
        self.stats.scrubs += 1;
        Ok(())
    }

    fn receive(&mut self, v: usize) -> Result<(), Broken> {
        let vol = &mut self.vols[v];
        let (cookie, error) = vol.conn.as_mut().expect("connected").recv()?;
        let Some(op) = vol.inflight.remove(&cookie) else {
            panic!("reply for unknown cookie {cookie} on {}", vol.name);
        };
        // With a device failed, a 1-replica volume holding an extent there cannot promise
        // durability any more: its FLUSH and FUA requests get EIO, and what they covered
        // stays acknowledged, not durable.
        let refused = error == NBD_EIO
            && (op.kind == Kind::Flush || op.fua)
            && self.failed_device.is_some()
            && !(self.replicated && vol.uid % 2 == 1);
        if error != 0 && !refused {
            let what = format!(
                "server answered {} with errno {error}",
                self.log.get(&op.tag).map_or("a FLUSH", String::as_str)
            );
            // With the server's log: the reply says only "EIO", the log says why.
            match self.server_log.clone() {
                Some(path) => self.fail_with_log(&path, &what),
                None => panic!("{what}"),
            }
        }
        for b in op.first..op.first + op.count {
            if let Some(busy) = vol.busy.get_mut(b as usize) {
                *busy = false;
            }
        }
        if refused {
            self.stats.durability_refused += 1;
            if op.kind == Kind::Flush {
                vol.acked_unflushed.extend(op.covers);
            } else {
                vol.acked_unflushed.push((op.first, op.count, op.tag));
            }
        } else if op.kind == Kind::Flush {
            for (first, count, tag) in op.covers {
                vol.make_durable(first, count, tag);
            }
        } else if op.fua {
            vol.make_durable(op.first, op.count, op.tag);
        } else {
            vol.acked_unflushed.push((op.first, op.count, op.tag));
        }
        *self.stats.acked.entry(op.kind).or_default() += 1;
        Ok(())
    }

    /// Picks a free range of `count` blocks, or `None` if it would overlap a request in flight.
    fn pick_range(&mut self, v: usize, count: u64, aligned_extents: bool) -> Option<u64> {
        let blocks = self.vols[v].block_count();
        let count = count.min(blocks);
        let per_extent = EXTENT / BLOCK;
        let first = if aligned_extents {
            let extents = blocks / per_extent;
            if extents * per_extent < count {
                return None;
            }
            self.rng.range(0, extents - count / per_extent) * per_extent
        } else if self.rng.chance(30) {
            // First touch of an extent that may be unallocated.
            let holes: Vec<usize> = (0..self.vols[v].maybe_hole.len())
                .filter(|&e| self.vols[v].maybe_hole[e])
                .collect();
            if holes.is_empty() {
                self.rng.range(0, blocks - count)
            } else {
                let e = holes[self.rng.range(0, holes.len() as u64 - 1) as usize] as u64;
                (e * per_extent + self.rng.range(0, per_extent - 1)).min(blocks - count)
            }
        } else {
            self.rng.range(0, blocks - count)
        };
        let busy = &self.vols[v].busy;
        if (first..first + count).any(|b| busy[b as usize]) {
            return None;
        }
        Some(first)
    }

    fn write(&mut self, v: usize) -> Result<(), Broken> {
        let count = if self.rng.chance(80) {
            self.rng.range(1, 16)
        } else {
            self.rng.range(17, 64)
        };
        let Some(first) = self.pick_range(v, count, false) else {
            return Ok(());
        };
        let count = count.min(self.vols[v].block_count());
        let fua = self.rng.chance(15);
        let tag = self.tag(false);
        let vol = &mut self.vols[v];
        let mut payload = Vec::with_capacity((count * BLOCK) as usize);
        for b in first..first + count {
            self.patterns.fill(&mut payload, vol.uid, b, tag);
        }
        let first_extent = (first * BLOCK / EXTENT) as usize;
        let last_extent = ((first + count) * BLOCK - 1) / EXTENT;
        let allocating = (first_extent..=last_extent as usize).any(|e| vol.maybe_hole[e]);
        for e in first_extent..=last_extent as usize {
            vol.maybe_hole[e] = false;
        }
        let kind = if allocating {
            Kind::AllocatingWrite
        } else if fua {
            Kind::FuaWrite
        } else {
            Kind::Write
        };
        self.log.insert(
            tag,
            format!(
                "cycle {} {kind:?}{} of {} blocks {first}..{}",
                self.cycle,
                if fua { " (FUA)" } else { "" },
                vol.name,
                first + count
            ),
        );
        self.next_cookie += 1;
        let cookie = self.next_cookie;
        let flags = if fua { NBD_CMD_FLAG_FUA } else { 0 };
        for b in first..first + count {
            vol.blocks[b as usize].push(tag);
            vol.busy[b as usize] = true;
        }
        vol.inflight.insert(
            cookie,
            Op {
                kind,
                first,
                count,
                tag,
                fua,
                covers: Vec::new(),
                allocating,
            },
        );
        *self.stats.sent.entry(kind).or_default() += 1;
        self.arm(kind);
        let vol = &mut self.vols[v];
        vol.conn.as_mut().expect("connected").send(
            NBD_CMD_WRITE,
            flags,
            cookie,
            first * BLOCK,
            (count * BLOCK) as u32,
            Some(&payload),
        )?;
        Ok(())
    }

    fn flush(&mut self, v: usize) -> Result<(), Broken> {
        let cookie = self.cookie();
        let vol = &mut self.vols[v];
        let covers = std::mem::take(&mut vol.acked_unflushed);
        vol.inflight.insert(
            cookie,
            Op {
                kind: Kind::Flush,
                first: 0,
                count: 0,
                tag: 0,
                fua: false,
                covers,
                allocating: false,
            },
        );
        *self.stats.sent.entry(Kind::Flush).or_default() += 1;
        self.arm(Kind::Flush);
        let vol = &mut self.vols[v];
        vol.conn
            .as_mut()
            .expect("connected")
            .send(NBD_CMD_FLUSH, 0, cookie, 0, 0, None)?;
        Ok(())
    }

    /// TRIM or WRITE_ZEROES: the range reads zeros afterwards (Headroom punches; with NO_HOLE
    /// it zeroes provisioned space).
    fn discard(&mut self, v: usize, command: u16) -> Result<(), Broken> {
        let whole = self.rng.chance(50);
        let count = if whole {
            self.rng.range(1, 3) * (EXTENT / BLOCK)
        } else {
            self.rng.range(1, 32)
        };
        let Some(first) = self.pick_range(v, count, whole) else {
            return Ok(());
        };
        let count = count.min(self.vols[v].block_count());
        let fua = self.rng.chance(20);
        let no_hole = command == NBD_CMD_WRITE_ZEROES && self.rng.chance(50);
        let tag = self.tag(true);
        let kind = if command == NBD_CMD_TRIM {
            Kind::Trim
        } else {
            Kind::WriteZeroes
        };
        let mut flags = if fua { NBD_CMD_FLAG_FUA } else { 0 };
        if no_hole {
            flags |= NBD_CMD_FLAG_NO_HOLE;
        }
        let cookie = self.cookie();
        let vol = &mut self.vols[v];
        self.log.insert(
            tag,
            format!(
                "cycle {} {kind:?}{}{} of {} blocks {first}..{}",
                self.cycle,
                if fua { " (FUA)" } else { "" },
                if no_hole { " (NO_HOLE)" } else { "" },
                vol.name,
                first + count
            ),
        );
        let per_extent = EXTENT / BLOCK;
        for e in first.div_ceil(per_extent)..(first + count) / per_extent {
            vol.maybe_hole[e as usize] = !no_hole;
        }
        if no_hole {
            for e in first / per_extent..=(first + count - 1) / per_extent {
                vol.maybe_hole[e as usize] = false;
            }
        }
        for b in first..first + count {
            vol.blocks[b as usize].push(tag);
            vol.busy[b as usize] = true;
        }
        vol.inflight.insert(
            cookie,
            Op {
                kind,
                first,
                count,
                tag,
                fua,
                covers: Vec::new(),
                allocating: no_hole,
            },
        );
        *self.stats.sent.entry(kind).or_default() += 1;
        self.arm(kind);
        let vol = &mut self.vols[v];
        vol.conn.as_mut().expect("connected").send(
            command,
            flags,
            cookie,
            first * BLOCK,
            (count * BLOCK) as u32,
            None,
        )?;
        Ok(())
    }

    /// Waits for every reply of volume `v` (before a resize or delete of it).
    fn drain(&mut self, v: usize) -> Result<(), Broken> {
        while !self.vols[v].inflight.is_empty() {
            self.receive(v)?;
        }
        Ok(())
    }

    fn create(&mut self, api: &Api, server: &Server) -> Result<(), Broken> {
        if self.vols.len() >= MAX_VOLUMES {
            return Ok(());
        }
        let uid = self.next_uid;
        self.next_uid += 1;
        let size = self.random_size();
        let vol = Vol::new(uid, size, Presence::MaybeCreated);
        let name = vol.name.clone();
        self.vols.push(vol);
        self.mgmt_inflight = Some(Kind::Create);
        *self.stats.sent.entry(Kind::Create).or_default() += 1;
        self.arm(Kind::Create);
        // Every other volume is replicated (a copy on each of the two devices).
        let replicas = if self.replicated { 1 + uid % 2 } else { 1 };
        api.call(
            "POST",
            "/v1/volumes",
            Some(json!({"name": name, "size_bytes": size, "replicas": replicas})),
        )?;
        self.mgmt_inflight = None;
        *self.stats.acked.entry(Kind::Create).or_default() += 1;
        let v = self.vols.len() - 1;
        self.vols[v].presence = Presence::Exists;
        self.connect(v, server)
    }

    fn connect(&mut self, v: usize, server: &Server) -> Result<(), Broken> {
        let vol = &mut self.vols[v];
        let conn = match Conn::open(server.nbd, &vol.name) {
            Ok(conn) => conn,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                panic!("{}: {err}", vol.name)
            }
            Err(err) => return Err(err.into()),
        };
        if conn.size_bytes != vol.size {
            let msg = format!(
                "{}: export size {}, expected {}",
                vol.name, conn.size_bytes, vol.size
            );
            self.fail(server, &msg);
        }
        vol.conn = Some(conn);
        Ok(())
    }

    fn resize(&mut self, v: usize, api: &Api, server: &Server) -> Result<(), Broken> {
        self.drain(v)?;
        let new_size = self.random_size();
        let vol = &mut self.vols[v];
        let old_size = vol.size;
        if new_size == old_size {
            return Ok(());
        }
        if let Some(conn) = vol.conn.take() {
            conn.disconnect();
        }
        // Until acknowledged: either size, and a shrink may already have zeroed the cut.
        vol.sizes = vec![old_size, new_size];
        if new_size > old_size {
            vol.set_blocks(new_size / BLOCK);
        } else {
            for history in &mut vol.blocks[(new_size / BLOCK) as usize..] {
                history.push(0);
            }
        }
        let name = vol.name.clone();
        self.mgmt_inflight = Some(Kind::Resize);
        *self.stats.sent.entry(Kind::Resize).or_default() += 1;
        self.arm(Kind::Resize);
        api.call(
            "PATCH",
            &format!("/v1/volumes/{name}"),
            Some(json!({"size_bytes": new_size})),
        )?;
        self.mgmt_inflight = None;
        *self.stats.acked.entry(Kind::Resize).or_default() += 1;
        let vol = &mut self.vols[v];
        vol.size = new_size;
        vol.sizes = vec![new_size];
        vol.set_blocks(new_size / BLOCK);
        self.connect(v, server)
    }

    fn delete(&mut self, v: usize, api: &Api) -> Result<(), Broken> {
        if self.live().len() < 2 {
            return Ok(());
        }
        self.drain(v)?;
        let vol = &mut self.vols[v];
        if let Some(conn) = vol.conn.take() {
            conn.disconnect();
        }
        // Until acknowledged it may survive, with any part of it already punched.
        vol.presence = Presence::MaybeDeleted;
        for history in &mut vol.blocks {
            history.push(0);
        }
        let name = vol.name.clone();
        self.mgmt_inflight = Some(Kind::Delete);
        *self.stats.sent.entry(Kind::Delete).or_default() += 1;
        self.arm(Kind::Delete);
        api.call("DELETE", &format!("/v1/volumes/{name}"), None)?;
        self.mgmt_inflight = None;
        *self.stats.acked.entry(Kind::Delete).or_default() += 1;
        self.vols.remove(v);
        self.gone.insert(name);
        Ok(())
    }

    /// The server flushed and exited 0 after SIGTERM: every write it acknowledged is durable
    /// (`Node::shutdown` flushes after the connections are closed); what was in flight stays
    /// "possible", as after a kill.
    fn stopped_cleanly(&mut self) {
        for vol in &mut self.vols {
            // Acknowledged since the last FLUSH was sent, and those an unanswered FLUSH covers.
            let mut acked = std::mem::take(&mut vol.acked_unflushed);
            for op in vol.inflight.values().filter(|op| op.kind == Kind::Flush) {
                acked.extend_from_slice(&op.covers);
            }
            self.stats.writes_durable_by_shutdown += acked.len() as u64;
            for (first, count, tag) in acked {
                vol.make_durable(first, count, tag);
            }
        }
        self.crashed();
    }

    /// The kill landed: what was in flight stays "possible", nothing more becomes durable.
    fn crashed(&mut self) {
        let mut during = BTreeSet::new();
        if let Some(kind) = self.mgmt_inflight.take() {
            during.insert(kind);
        }
        for vol in &mut self.vols {
            for op in vol.inflight.values() {
                during.insert(op.kind);
                if op.allocating {
                    during.insert(Kind::AllocatingWrite);
                }
                if op.fua {
                    during.insert(Kind::FuaWrite);
                }
            }
            vol.inflight.clear();
            vol.busy.iter_mut().for_each(|b| *b = false);
            vol.acked_unflushed.clear();
            vol.conn = None;
        }
        for kind in during {
            *self.stats.killed_during.entry(kind).or_default() += 1;
        }
    }

    // ----- the checker --------------------------------------------------------------------

    fn describe(&self, tag: u64) -> String {
        if tag == 0 {
            "zeros (never written)".to_string()
        } else {
            self.log
                .get(&tag)
                .cloned()
                .unwrap_or_else(|| format!("unknown tag {tag}"))
        }
    }

    /// After a restart: the pool has every device whose add was acknowledged, and an add cut
    /// by a crash either happened or not.
    fn verify_devices(&mut self, server: &Server, api: &Api) {
        let listed = match api.call("GET", "/v1/devices", None) {
            Ok(list) => list,
            Err(Broken(e)) => self.fail(server, &format!("restarted server's API: {e}")),
        };
        let list = listed.as_array().expect("device list is an array");
        let n = list.len() as u64;
        let failed: Vec<u64> = list
            .iter()
            .filter(|d| d["failed"].as_bool() == Some(true))
            .map(|d| d["id"].as_u64().expect("device id"))
            .collect();
        let allowed: Vec<u64> = self
            .failed_device
            .iter()
            .chain(&self.fail_maybe)
            .copied()
            .collect();
        if failed.iter().any(|id| !allowed.contains(id))
            || self.failed_device.is_some_and(|id| !failed.contains(&id))
        {
            let msg = format!(
                "failed devices {failed:?}; expected {:?}, maybe {:?}",
                self.failed_device, self.fail_maybe
            );
            self.fail(server, &msg);
        }
        if let Some(id) = self.fail_maybe.take() {
            let outcome = if failed.contains(&id) {
                self.failed_device = Some(id);
                "unacknowledged device fail done"
            } else {
                "unacknowledged device fail undone"
            };
            *self.stats.outcomes.entry(outcome).or_default() += 1;
        }
        if n < self.devices || n > self.devices + self.devices_maybe {
            let msg = format!(
                "the pool has {n} devices, expected {} to {}",
                self.devices,
                self.devices + self.devices_maybe
            );
            self.fail(server, &msg);
        }
        if self.devices_maybe > 0 {
            let outcome = if n > self.devices {
                "unacknowledged device add done"
            } else {
                "unacknowledged device add undone"
            };
            *self.stats.outcomes.entry(outcome).or_default() += 1;
        }
        self.devices = n;
        self.devices_maybe = 0;
    }

    /// After a restart: the volume list, sizes and every block.
    fn verify(&mut self, server: &Server, api: &Api) {
        if self.device_ops {
            self.verify_devices(server, api);
        }
        let listed = match api.call("GET", "/v1/volumes", None) {
            Ok(list) => list,
            Err(Broken(e)) => self.fail(server, &format!("restarted server's API: {e}")),
        };
        let mut on_server: BTreeMap<String, u64> = BTreeMap::new();
        for v in listed.as_array().expect("volume list is an array") {
            let name = v["name"].as_str().expect("name").to_string();
            let size = v["size_bytes"].as_u64().expect("size_bytes");
            on_server.insert(name, size);
        }
        for name in on_server.keys() {
            if self.gone.contains(name) {
                self.fail(server, &format!("volume {name} is back after its delete"));
            }
            if !self.vols.iter().any(|v| &v.name == name) {
                self.fail(server, &format!("unknown volume {name} listed"));
            }
        }
        let mut keep = Vec::new();
        for mut vol in std::mem::take(&mut self.vols) {
            match on_server.get(&vol.name) {
                None if vol.presence == Presence::Exists => {
                    self.vols.push(vol);
                    let name = self.vols.last().unwrap().name.clone();
                    self.fail(
                        server,
                        &format!("volume {name} (create acknowledged) is missing"),
                    );
                }
                None => {
                    let outcome = match vol.presence {
                        Presence::MaybeCreated => "unacknowledged create undone",
                        _ => "unacknowledged delete done",
                    };
                    *self.stats.outcomes.entry(outcome).or_default() += 1;
                    self.gone.insert(vol.name.clone());
                }
                Some(&size) => {
                    if !vol.sizes.contains(&size) {
                        let msg = format!(
                            "volume {} has size {size}, expected one of {:?}",
                            vol.name, vol.sizes
                        );
                        self.vols.push(vol);
                        self.fail(server, &msg);
                    }
                    let outcome = match vol.presence {
                        Presence::MaybeCreated => Some("unacknowledged create done"),
                        Presence::MaybeDeleted => Some("unacknowledged delete undone"),
                        Presence::Exists if vol.sizes.len() > 1 && size == vol.sizes[0] => {
                            Some("unacknowledged resize undone")
                        }
                        Presence::Exists if vol.sizes.len() > 1 => {
                            Some("unacknowledged resize done")
                        }
                        Presence::Exists => None,
                    };
                    if let Some(outcome) = outcome {
                        *self.stats.outcomes.entry(outcome).or_default() += 1;
                    }
                    vol.size = size;
                    vol.sizes = vec![size];
                    vol.presence = Presence::Exists;
                    vol.set_blocks(size / BLOCK);
                    keep.push(vol);
                }
            }
        }
        self.vols = keep;
        for v in 0..self.vols.len() {
            self.verify_volume(v, server);
        }
        // Forget the descriptions of versions no block can hold any more (long runs).
        let live: BTreeSet<u64> = self
            .vols
            .iter()
            .flat_map(|v| v.blocks.iter().flatten().copied())
            .collect();
        self.log.retain(|tag, _| live.contains(tag));
    }

    fn verify_volume(&mut self, v: usize, server: &Server) {
        let name = self.vols[v].name.clone();
        let mut conn = match Conn::open(server.nbd, &name) {
            Ok(conn) => conn,
            Err(e) => self.fail(server, &format!("cannot open {name} after restart: {e}")),
        };
        if conn.size_bytes != self.vols[v].size {
            let msg = format!(
                "{name}: export size {} but the API says {}",
                conn.size_bytes, self.vols[v].size
            );
            self.fail(server, &msg);
        }
        let size = self.vols[v].size;
        let mut buf = vec![0u8; MIB as usize];
        let mut offset = 0;
        while offset < size {
            let len = MIB.min(size - offset) as usize;
            let cookie = self.cookie();
            match conn.read(cookie, offset, &mut buf[..len]) {
                Ok(Ok(())) => {}
                Ok(Err(errno)) => self.fail(
                    server,
                    &format!("{name}: READ at {offset} got errno {errno}"),
                ),
                Err(e) => self.fail(server, &format!("{name}: READ at {offset}: {e}")),
            }
            for (i, data) in buf[..len].chunks(BLOCK as usize).enumerate() {
                let b = offset / BLOCK + i as u64;
                if let Err(msg) = self.check_block(v, b, data) {
                    self.fail(server, &msg);
                }
            }
            offset += len as u64;
        }
        self.stats.volumes_checked += 1;
        // An extent that reads all zeros may be a hole again (its allocation was lost).
        let per_extent = (EXTENT / BLOCK) as usize;
        let vol = &mut self.vols[v];
        for (e, hole) in vol.maybe_hole.iter_mut().enumerate() {
            let end = ((e + 1) * per_extent).min(vol.blocks.len());
            *hole = vol.blocks[e * per_extent..end].iter().all(|h| h == &[0]);
        }
        vol.conn = Some(conn);
    }

    fn check_block(&mut self, v: usize, b: u64, data: &[u8]) -> Result<(), String> {
        let vol = &self.vols[v];
        let history = &vol.blocks[b as usize];
        let found = history.iter().copied().find(|&tag| {
            if is_zero_tag(tag) {
                data == self.patterns.zero.as_slice()
            } else {
                self.patterns.matches(data, vol.uid, b, tag)
            }
        });
        self.stats.blocks_checked += 1;
        if !is_zero_tag(history[0]) {
            self.stats.durable_data_blocks_checked += 1;
        }
        if history.len() > 1 {
            self.stats.ambiguous_blocks_checked += 1;
        }
        match found {
            Some(tag) => {
                self.vols[v].blocks[b as usize] = vec![if is_zero_tag(tag) { 0 } else { tag }];
                Ok(())
            }
            None => {
                let mut msg = format!(
                    "{} block {b} (byte {}) lost its durable contents.\n  durable: {}\n",
                    vol.name,
                    b * BLOCK,
                    self.describe(history[0])
                );
                for &tag in &history[1..] {
                    let _ = writeln!(msg, "  or later: {}", self.describe(tag));
                }
                let found = match self.patterns.identify(data) {
                    Found::Zero => "zeros".to_string(),
                    Found::Garbage => format!("unrecognised bytes {:02x?}", &data[..32]),
                    Found::Stamped { uid, block, tag } => format!(
                        "data of volume uid {uid} block {block}, written by {}",
                        self.describe(tag)
                    ),
                };
                let _ = write!(msg, "  found: {found}");
                Err(msg)
            }
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|s| {
        s.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name} must be a number, got {s:?}"))
    })
}

/// Names the seed and the cycle when the test panics anywhere (an assertion in the writer,
/// the server failing to start, a failed check).
struct FailureNote {
    seed: u64,
    cycle: Arc<AtomicU64>,
}

impl Drop for FailureNote {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let cycle = self.cycle.load(Ordering::SeqCst);
            say(&format!(
                "crash consistency FAILED in cycle {cycle} (seed {seed}); replay: \
                 HEADROOM_CRASH_SEED={seed} HEADROOM_CRASH_CYCLES={}",
                cycle + 1,
                seed = self.seed
            ));
        }
    }
}

fn say(line: &str) {
    // Straight to stderr, past the test harness's capture, so CI logs show the count.
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Opens the stopped server's store and compares the copies of every allocated extent of
/// every replicated volume: (replicated volumes, extents compared). Panics on a difference.
fn compare_replicas(data_dir: &std::path::Path) -> (usize, u64) {
    // A copy on a failed device missed the writes since it failed (the rebuild replaces
    // it): only extents whose copies are all on healthy devices must agree.
    let store = headroom_store::Store::open(&headroom_store::StoreConfig::new(data_dir))
        .expect("open the store after the run");
    let mut a = vec![0u8; EXTENT as usize];
    let mut b = vec![0u8; EXTENT as usize];
    let (mut volumes, mut compared) = (0, 0);
    for info in store.list_volumes().into_iter().filter(|i| i.replicas > 1) {
        volumes += 1;
        let v = store.open_volume(&info.name).expect("open volume");
        for extent in 0..info.size_bytes.div_ceil(EXTENT) {
            if v.copies(extent)
                .iter()
                .flatten()
                .any(|(_, healthy)| !healthy)
            {
                continue;
            }
            if v.replica_location(0, extent).is_none() {
                assert!(
                    v.replica_location(1, extent).is_none(),
                    "{} {extent}",
                    info.name
                );
                continue;
            }
            let len = (info.size_bytes - extent * EXTENT).min(EXTENT) as usize;
            v.read_replica_at(0, extent * EXTENT, &mut a[..len])
                .expect("read replica 0");
            v.read_replica_at(1, extent * EXTENT, &mut b[..len])
                .expect("read replica 1");
            assert!(
                a[..len] == b[..len],
                "volume {} extent {extent}: the copies differ",
                info.name
            );
            compared += 1;
        }
    }
    (volumes, compared)
}

/// Starts the server and SIGKILLs it `delay` later without waiting for it to be ready: a
/// kill during the recovery that follows a crash (startup punch, replica resync, the open
/// commit). Returns whether it had printed its addresses (finished starting) by then, and
/// whether its log shows the startup punch done (the kill then landed in or after recovery).
fn start_and_kill(data_dir: &std::path::Path, args: &[String], delay: Duration) -> (bool, bool) {
    let log_path = data_dir.with_extension("log");
    let log_before = std::fs::metadata(&log_path).map_or(0, |m| m.len());
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(data_dir.with_extension("log"))
        .expect("open log");
    let mut child = std::process::Command::new(common::BIN)
        .arg("serve")
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--nbd-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"])
        .args(args)
        .env("HEADROOM_TOKEN", common::TEST_TOKEN)
        .env("HEADROOM_LOG", "debug")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::from(log))
        .spawn()
        .expect("spawn headroom serve");
    let stdout = child.stdout.take().expect("stdout");
    let ready = Arc::new(AtomicBool::new(false));
    let reader = {
        let ready = Arc::clone(&ready);
        std::thread::spawn(move || {
            use std::io::BufRead as _;
            for line in std::io::BufReader::new(stdout).lines() {
                match line {
                    Ok(line) if line.starts_with("nbd://") => ready.store(true, Ordering::SeqCst),
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        })
    };
    // The random moment of the kill (like the killer thread's delay), not a synchronisation.
    std::thread::sleep(delay);
    let was_ready = ready.load(Ordering::SeqCst);
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();
    let log = std::fs::read(&log_path).unwrap_or_default();
    let tail = String::from_utf8_lossy(log.get(log_before as usize..).unwrap_or_default());
    (was_ready, tail.contains("punched all free extents"))
}

fn file_setup() -> Setup {
    Setup {
        server_args: SERVER_ARGS.iter().map(|s| s.to_string()).collect(),
        replicated: true,
        device_ops: true,
    }
}

/// Share of cycles that end with SIGTERM instead of SIGKILL, and of those, the share whose
/// SIGTERM is followed by a SIGKILL during the shutdown.
const TERM_PERCENT: u64 = 15;
const TERM_THEN_KILL_PERCENT: u64 = 40;
/// Share of restarts preceded by 1-3 servers killed while starting (during recovery).
const EARLY_KILL_PERCENT: u64 = 30;
/// Range of the delay between spawning such a server and killing it.
const EARLY_KILL_MS: (u64, u64) = (0, 60);

#[test]
fn acknowledged_durable_data_survives_sigkill_at_random_moments() {
    let cycles = env_u64("HEADROOM_CRASH_CYCLES").unwrap_or(100);
    run(&file_setup(), cycles, "crash consistency");
}

/// The same harness against a Headroom whose store is a Ceph RADOS pool (the test cluster
/// `scripts/test` starts): one copy per extent (Ceph keeps the replicas), no device adds or
/// scrubs (the pool is one device); each restart waits for the killed node's lease to expire
/// (2 s here: a 1 s lease ran out on a loaded CI machine while the node fenced). `HEADROOM_CRASH_RADOS_CYCLES` (default 12) sets the cycles.
#[test]
fn rados_acknowledged_durable_data_survives_sigkill_at_random_moments() {
    let Some(conf) = std::env::var_os("HEADROOM_TEST_CEPH_CONF") else {
        let why = "no Ceph cluster: set HEADROOM_TEST_CEPH_CONF (scripts/test starts one with \
                   scripts/ceph-test-cluster)";
        if std::env::var_os("HEADROOM_REQUIRE_TOOLS").is_some() {
            panic!("the RADOS crash loop must run here (HEADROOM_REQUIRE_TOOLS is set): {why}");
        }
        eprintln!("SKIPPED: {why}");
        return;
    };
    if !headroom_store::RADOS_SUPPORTED {
        let why = "this test build has no RADOS backend (build with --features headroom/rados)";
        if std::env::var_os("HEADROOM_REQUIRE_TOOLS").is_some() {
            panic!("the RADOS crash loop must run here (HEADROOM_REQUIRE_TOOLS is set): {why}");
        }
        eprintln!("SKIPPED: {why}");
        return;
    }
    let pool = std::env::var("HEADROOM_TEST_CEPH_POOL").unwrap_or_else(|_| "headroom".into());
    // The cephx user the nodes connect as (scripts/test: the dedicated `headroom`).
    let id = std::env::var("HEADROOM_TEST_CEPH_ID").unwrap_or_else(|_| "admin".into());
    let setup = Setup {
        server_args: vec![
            "--rados-conf".into(),
            conf.to_str().expect("UTF-8 ceph.conf path").into(),
            "--rados-id".into(),
            id,
            "--rados-pool".into(),
            pool,
            "--device-size".into(),
            "1GiB".into(),
            "--rados-lease-ms".into(),
            "2000".into(),
        ],
        replicated: false,
        device_ops: false,
    };
    let cycles = env_u64("HEADROOM_CRASH_RADOS_CYCLES").unwrap_or(12);
    run(&setup, cycles, "RADOS crash consistency");
}

fn run(setup: &Setup, cycles: u64, what: &str) {
    let seed = env_u64("HEADROOM_CRASH_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    say(&format!(
        "{what}: {cycles} cycles, seed {seed} (replay: HEADROOM_CRASH_SEED={seed})"
    ));
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let data_dir = dir.path().join("data");
    let mut h = Harness::new(seed, setup);
    h.server_log = Some(data_dir.with_extension("log"));
    let current_cycle = Arc::new(AtomicU64::new(0));
    let _note = FailureNote {
        seed,
        cycle: Arc::clone(&current_cycle),
    };
    let args: Vec<&str> = setup.server_args.iter().map(String::as_str).collect();

    let mut server = Server::start_with(&data_dir, &args);
    {
        let api = Api::new(&server.api);
        for _ in 0..3 {
            if let Err(Broken(e)) = h.create(&api, &server) {
                h.fail(&server, &format!("initial create: {e}"));
            }
        }
    }
    for cycle in 0..cycles {
        h.cycle = cycle;
        current_cycle.store(cycle, Ordering::SeqCst);
        if cycle > 0 && cycle % 100 == 0 {
            say(&format!(
                "{what}: {cycle} cycles done in {:.1} s",
                started.elapsed().as_secs_f64()
            ));
        }
        let api = Api::new(&server.api);
        for v in 0..h.vols.len() {
            if h.vols[v].conn.is_none()
                && let Err(Broken(e)) = h.connect(v, &server)
            {
                h.fail(&server, &format!("connect before the kill: {e}"));
            }
        }
        let killed = Arc::new(AtomicBool::new(false));
        let delay = Duration::from_millis(h.rng.range(KILL_DELAY_MS.0, KILL_DELAY_MS.1));
        let end = if h.rng.chance(TERM_PERCENT) {
            if h.rng.chance(TERM_THEN_KILL_PERCENT) {
                End::TermThenKill
            } else {
                End::Term
            }
        } else {
            End::Kill
        };
        let kill_after_term = Duration::from_micros(h.rng.range(0, 20_000));
        let (fuse, lit) = mpsc::channel::<Duration>();
        // Half the cycles aim the kill at one kind of request (so that the rare, short ones,
        // management commits above all, are hit too); the others kill on the timer alone.
        h.target = None;
        h.fuse = None;
        if h.rng.chance(TARGETED_PERCENT) {
            let targets: &[Kind] = if setup.device_ops {
                &[
                    Kind::Create,
                    Kind::Resize,
                    Kind::Delete,
                    Kind::Flush,
                    Kind::AllocatingWrite,
                    Kind::FuaWrite,
                    Kind::Trim,
                    Kind::DeviceAdd,
                    Kind::Scrub,
                    Kind::DeviceFail,
                ]
            } else {
                &[
                    Kind::Create,
                    Kind::Resize,
                    Kind::Delete,
                    Kind::Flush,
                    Kind::AllocatingWrite,
                    Kind::FuaWrite,
                    Kind::Trim,
                ]
            };
            h.target = Some(targets[h.rng.range(0, targets.len() as u64 - 1) as usize]);
            h.steps_before_target = h.rng.range(0, 300);
            h.fuse = Some(fuse);
        }
        let pid = server.pid();
        let killer = {
            let killed = Arc::clone(&killed);
            std::thread::spawn(move || {
                if let Ok(short) = lit.recv_timeout(delay) {
                    std::thread::sleep(short);
                }
                killed.store(true, Ordering::SeqCst);
                let signal = |name: &str| {
                    let _ = std::process::Command::new("kill")
                        .args([name, &pid.to_string()])
                        .status();
                };
                match end {
                    End::Kill => signal("-KILL"),
                    End::Term => signal("-TERM"),
                    End::TermThenKill => {
                        signal("-TERM");
                        std::thread::sleep(kill_after_term);
                        signal("-KILL");
                    }
                }
            })
        };
        let broken = loop {
            if let Err(Broken(e)) = h.step(&api, &server) {
                break e;
            }
        };
        killer.join().expect("killer thread");
        if !killed.load(Ordering::SeqCst) {
            h.fail(
                &server,
                &format!("connection broke before the kill: {broken}"),
            );
        }
        let clean = match end {
            End::Kill => {
                server.kill9();
                false
            }
            End::Term | End::TermThenKill => {
                let status = server.stop_any();
                if end == End::Term && !status.success() {
                    panic!(
                        "{what} FAILED at cycle {cycle} (seed {seed}): the server exited with \
                         {status} after SIGTERM"
                    );
                }
                status.success()
            }
        };
        let outcome = match (end, clean) {
            (End::Kill, _) => "SIGKILL",
            (End::Term, _) => "SIGTERM, exit 0",
            (End::TermThenKill, true) => "SIGTERM then SIGKILL, exited 0 first",
            (End::TermThenKill, false) => "SIGTERM then SIGKILL, killed in the shutdown",
        };
        *h.stats.ends.entry(outcome).or_default() += 1;
        if clean {
            h.stopped_cleanly();
        } else {
            h.crashed();
        }

        // Sometimes the next start is killed too, while it recovers from this one.
        if h.rng.chance(EARLY_KILL_PERCENT) {
            for _ in 0..h.rng.range(1, 3) {
                let delay = Duration::from_millis(h.rng.range(EARLY_KILL_MS.0, EARLY_KILL_MS.1));
                let (was_ready, punched) = start_and_kill(&data_dir, &setup.server_args, delay);
                h.stats.early_kills += 1;
                if !was_ready {
                    h.stats.early_kills_before_ready += 1;
                    if punched {
                        h.stats.early_kills_after_punch += 1;
                    }
                }
            }
        }

        server = Server::start_with(&data_dir, &args);
        let api = Api::new(&server.api);
        h.verify(&server, &api);
    }
    for vol in &mut h.vols {
        if let Some(conn) = vol.conn.take() {
            conn.disconnect();
        }
    }
    server.stop();
    let (replicated, extents_compared) = if setup.replicated {
        compare_replicas(&data_dir)
    } else {
        (0, 0)
    };

    let elapsed = started.elapsed();
    let s = &h.stats;
    let fmt = |m: &BTreeMap<Kind, u64>| {
        m.iter()
            .map(|(k, n)| format!("{k:?} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let fmt_str = |m: &BTreeMap<&'static str, u64>| {
        m.iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    say(&format!(
        "{what}: {cycles} kill/restart cycles in {:.1} s (seed {seed}); \
         {} blocks checked ({} with durable data, {} with more than one allowed version) \
         in {} volume checks",
        elapsed.as_secs_f64(),
        s.blocks_checked,
        s.durable_data_blocks_checked,
        s.ambiguous_blocks_checked,
        s.volumes_checked
    ));
    say(&format!(
        "  how cycles ended: {}; {} acknowledged unflushed writes made durable by clean \
         shutdowns",
        fmt_str(&s.ends),
        s.writes_durable_by_shutdown
    ));
    say(&format!(
        "  servers killed while starting: {} ({} before they were ready, {} of those after \
         the startup punch of the recovery)",
        s.early_kills, s.early_kills_before_ready, s.early_kills_after_punch
    ));
    if setup.replicated {
        say(&format!(
            "  replicated volumes at the end: {replicated}, {extents_compared} extents whose \
             two copies compared equal; {} scrubs found the copies equal; pool of {} devices, \
             failed by the operator: {:?}; {} FLUSH/FUA of 1-replica volumes refused (EIO) \
             for data on it",
            s.scrubs, h.devices, h.failed_device, s.durability_refused
        ));
    }
    say(&format!("  requests sent: {}", fmt(&s.sent)));
    say(&format!("  acknowledged:  {}", fmt(&s.acked)));
    say(&format!(
        "  cycles whose kill landed with in flight: {}",
        fmt(&s.killed_during)
    ));
    say(&format!(
        "  management calls cut by the kill, after the restart: {}",
        fmt_str(&s.outcomes)
    ));
    assert!(
        cycles == 0 || (s.blocks_checked > 0 && s.volumes_checked >= cycles),
        "the checker checked nothing"
    );
}
