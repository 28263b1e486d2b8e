//! Durable metadata in redb: format, devices, volumes and extent maps.
//!
//! Why: the extent maps are what make a volume's bytes findable after a restart, so they
//! live in a crash-safe transactional store. redb commits with `Durability::Immediate`
//! (checksummed commit slot + fsync), so a commit that returned is on disk, and a crash mid-
//! commit leaves the previous state. This module only encodes and decodes; *when* to commit
//! is the store's protocol (see `store.rs`).
//!
//! Tables:
//! - `meta`: `&str -> u64` (`format_version`, `extent_size_bytes`, `next_volume_id`, `clean`,
//!   `pool_id`: a random id written on the pool's device signatures, added at the first open
//!   by a build that signs devices)
//! - `devices`: `u32 -> JSON DeviceRecord`
//! - `volumes`: `u64 -> JSON VolumeRecord` (the record carries the volume's QoS as an opaque
//!   string: the store must not depend on the QoS crate, so the node layer owns its meaning)
//! - `extents`: `(volume id, logical extent) -> (device << 32 | physical extent)`: replica 0
//!   of every volume (the only copy of a 1-replica volume)
//! - `replica_extents`: `(volume id, replica, logical extent) -> (device << 32 | physical
//!   extent)`: replicas 1 and 2 of replicated volumes. A logical extent's rows of every
//!   replica are written and removed in the same transaction. Absent (empty) in databases
//!   of builds before replication and in pools without replicated volumes.
//! - `tenants`: `&str (tenant id) -> JSON TenantRecord`: the tenants the operator created. A
//!   database of a build before this table has none; opening it registers every tenant its
//!   volumes name, so old data directories keep working.
//! - `credits`: `u64 (volume id) -> opaque bytes`: the node's runtime QoS state (credit
//!   balances), saved about once a second in its own transaction. It is kept apart from
//!   `volumes` so that a save rewrites small rows and never the volume records, and a row goes
//!   away in the same transaction as its volume.
//!
//! The additions are backward compatible, so `FORMAT_VERSION` stays 1: a record without
//! `qos`, `tenant` or `read_only` loads as no QoS, no tenant and writable, a missing `credits`
//! table reads as empty, and a record without them is written exactly as before (so an older
//! build still reads it). An older build reading a record *with* `tenant` or `read_only`
//! ignores them (serde skips unknown fields) and would serve the volume to everyone,
//! writable: do not downgrade a node that has tenant volumes. The same holds for
//! `replicas` (a volume record field, absent for 1 replica) and `failure_domain` / `failed`
//! (device record fields): an older build would serve replica 0 only and count the other
//! replicas' extents as free space, so do not downgrade a node with replicated volumes.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::commit_watch::{CommitInProgress, CommitWatch, hung_reason};
use crate::error::{MetadataError, StoreError};
use crate::layout::{EXTENT_SIZE_BYTES, PhysExtent};
use crate::meta_file::{CACHE_SIZE_BYTES, OpenFailure, copy_file, file_len, open_checked};
use crate::meta_reserve::{Reserve, is_no_space};
use crate::sync::{lock, read, write};

const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const DEVICES: TableDefinition<u32, &str> = TableDefinition::new("devices");
const VOLUMES: TableDefinition<u64, &str> = TableDefinition::new("volumes");
const EXTENTS: TableDefinition<(u64, u64), u64> = TableDefinition::new("extents");
const REPLICA_EXTENTS: TableDefinition<(u64, u64, u64), u64> =
    TableDefinition::new("replica_extents");
const CREDITS: TableDefinition<u64, &[u8]> = TableDefinition::new("credits");
const TENANTS: TableDefinition<&str, &str> = TableDefinition::new("tenants");

/// Version of the table layout above; bump on any incompatible change.
pub(crate) const FORMAT_VERSION: u64 = 1;

pub(crate) const KEY_FORMAT: &str = "format_version";
pub(crate) const KEY_EXTENT_SIZE: &str = "extent_size_bytes";
pub(crate) const KEY_NEXT_VOLUME_ID: &str = "next_volume_id";
pub(crate) const KEY_CLEAN: &str = "clean";
pub(crate) const KEY_POOL_ID: &str = "pool_id";

pub(crate) const KEY_COMMIT_SEQ: &str = "commit_seq";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DeviceRecord {
    /// Path as given, or relative to the data directory when `relative` is set.
    pub path: String,
    pub relative: bool,
    pub capacity_bytes: u64,
    /// The failure domain the operator declared (a host, a shelf, a power feed): replicas
    /// of one extent go to distinct domains when the pool has enough. Absent: none declared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
    /// The operator failed the device (`headroom device fail`): it is never read, written
    /// or allocated on again. Absent (false) in records of older builds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
    /// Extents at the start of the device kept for Headroom's own structures (the signature,
    /// `signature.rs`), never allocated. Absent (0) in records of older builds: such a device
    /// is unsigned and loads as before.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reserved_extents: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct VolumeRecord {
    pub name: String,
    pub size_bytes: u64,
    pub created_unix_s: u64,
    /// Opaque QoS settings (JSON owned by the node layer); absent in records of older builds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qos: Option<String>,
    /// The tenant the volume belongs to (a TLS client's PSK identity or certificate CN);
    /// absent in records of older builds and for volumes of no tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Exported read-only; absent (false) in records of older builds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// Copies of every extent, on distinct devices (1 to `MAX_REPLICAS`); absent (1) in
    /// records of older builds and of 1-replica volumes, so those are written as before.
    #[serde(default = "one_replica", skip_serializing_if = "is_one_replica")]
    pub replicas: u8,
    /// Where the volume is attached besides NBD (opaque JSON owned by the node layer: its
    /// vhost-user sockets); absent in records of older builds and of unattached volumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachments: Option<String>,
}

fn one_replica() -> u8 {
    1
}

fn is_one_replica(n: &u8) -> bool {
    *n == 1
}

/// A tenant as stored (its id is the key).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TenantRecord {
    pub created_unix_s: u64,
}

/// Everything stored, as loaded at open.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Loaded {
    pub next_volume_id: u64,
    /// The previous process shut down after committing everything and punching all frees.
    pub clean: bool,
    /// The pool's random id (`KEY_POOL_ID`); `None` before a build that signs devices.
    pub pool_id: Option<u64>,
    pub devices: Vec<(u32, DeviceRecord)>,
    pub volumes: Vec<(u64, VolumeRecord)>,
    pub extents: Vec<(u64, u64, PhysExtent)>,
    /// Rows of replicas 1 and 2: (volume id, replica, logical extent, physical extent).
    pub replica_extents: Vec<(u64, u8, u64, PhysExtent)>,
    /// Empty for a database of a build before the `tenants` table.
    pub tenants: Vec<(String, TenantRecord)>,
}

/// One change to an extent map row (of replica `replica`: 0 is the `extents` table).
#[derive(Clone, Copy, Debug)]
pub(crate) enum ExtentChange {
    Map {
        volume_id: u64,
        replica: u8,
        extent: u64,
        phys: PhysExtent,
    },
    Unmap {
        volume_id: u64,
        replica: u8,
        extent: u64,
    },
}

/// A management change committed together with pending extent changes.
#[derive(Clone, Debug)]
pub(crate) enum MetaOp {
    Init,
    PutDevice(u32, DeviceRecord),
    PutVolume(u64, VolumeRecord),
    DeleteVolume(u64),
    SetNextVolumeId(u64),
    SetClean(bool),
    PutTenant(String, TenantRecord),
    DeleteTenant(String),
    /// Sets `failed` in the record of device `id` (which must exist).
    FailDevice(u32),
    /// Records the pool's id (`KEY_POOL_ID`).
    SetPoolId(u64),
    /// Clears `failed` in the record of device `id` (`Store::restore_device`).
    RestoreDevice(u32),
}

/// Opens (again) the redb database of a `Meta`: the file, or another backend.
pub(crate) type Opener = Box<dyn Fn() -> Result<Database, StoreError> + Send + Sync>;

/// Where the metadata lives: redb (file and RAM stores, and RADOS stores of the first
/// slice that kept `meta.redb`), or the omap of one RADOS object (`rados_meta.rs`).
///
/// After an I/O error redb refuses every later call on the handle (`PreviousIo`) until the
/// database is opened again. So the handle can be replaced: a write that fails with an I/O
/// error (or on a poisoned handle) drops the database, opens it again with `opener` (redb
/// recovers the last committed state) and runs once more; an ENOSPC first releases the
/// metadata reserve (`meta_reserve.rs`). `None` in `db` only after a reopen failed: the next
/// write tries again.
pub(crate) struct Meta {
    db: RwLock<Option<Database>>,
    /// How to open the database again; `None` (RAM) never reopens.
    opener: Option<Opener>,
    /// Space held back for metadata commits (file stores).
    reserve: Option<Reserve>,
    /// The second copy and the primary's path (file stores).
    copy: Option<(Copy, PathBuf)>,
    /// Why the last metadata write failed; `None` after a success.
    last_error: Mutex<Option<String>>,
    /// The commits in progress and since when (`commit_watch.rs`): one that hangs is named
    /// by `health`, without I/O.
    commits: CommitWatch,
    #[cfg(feature = "rados")]
    rados: Option<crate::rados_meta::RadosMeta>,
}

impl std::fmt::Debug for Meta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Meta")
            .field("reopens", &self.opener.is_some())
            .field("reserve", &self.reserve)
            .finish_non_exhaustive()
    }
}

/// Whether the metadata can be committed now (`Store::commit_health`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitHealth {
    /// Why not, one sentence each; empty: commits work and the reserve is intact.
    pub reasons: Vec<String>,
}

impl CommitHealth {
    /// Metadata commits work and the reserve is intact.
    pub fn is_ready(&self) -> bool {
        self.reasons.is_empty()
    }
}

/// Whether a redb failure leaves the handle unusable until it is opened again: an I/O error,
/// a handle poisoned by an earlier one, or redb's own "reopen to repair" corruption report
/// (a failed commit discards the allocator state).
fn needs_reopen(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Metadata(MetadataError::Redb(
            redb::Error::Io(_) | redb::Error::PreviousIo | redb::Error::Corrupted(_)
        )) | StoreError::Metadata(MetadataError::Closed(_))
    )
}

fn is_enospc(e: &StoreError) -> bool {
    matches!(e, StoreError::Metadata(MetadataError::Redb(redb::Error::Io(io))) if is_no_space(io))
}

/// The error for a failed open of the metadata file at `path`.
pub(crate) fn open_failure_err(path: &Path, f: OpenFailure) -> StoreError {
    match f {
        OpenFailure::Damaged(detail) => MetadataError::Damaged {
            path: path.display().to_string(),
            data_dir: path
                .parent()
                .unwrap_or(Path::new("."))
                .display()
                .to_string(),
            detail,
        }
        .into(),
        OpenFailure::Busy => MetadataError::Redb(redb::Error::DatabaseAlreadyOpen).into(),
        OpenFailure::NoSpace(io) => MetadataError::Redb(redb::Error::Io(io)).into(),
        OpenFailure::Other(detail) => {
            MetadataError::Closed(format!("opening {}: {detail}", path.display())).into()
        }
    }
}

/// `e`, or the damaged-file error for `path` if redb found the file corrupted.
pub(crate) fn damaged_if_corrupt(e: StoreError, path: &Path) -> StoreError {
    match e {
        StoreError::Metadata(MetadataError::Redb(redb::Error::Corrupted(d))) => {
            open_failure_err(path, OpenFailure::Damaged(d))
        }
        other => other,
    }
}

/// The second durable copy of the metadata (`meta-copy.redb`): every extent-map and
/// management commit is applied to it after the primary, with the same commit number, so
/// it is the primary's state or (after a crash between the two) one commit behind. A write
/// to it that fails leaves it `stale`: the commit still counts (the primary has it; a FLUSH
/// does not fail because the copy's disk did), the health names it, and the next commit
/// rewrites the copy from the primary. Credit saves go to the primary only.
struct Copy {
    path: PathBuf,
    db: RwLock<Option<Database>>,
    stale: Mutex<Option<String>>,
}

impl Copy {
    /// Rewrites the copy from the primary's file. `primary` is the primary's lock, held for
    /// writing during the copy so that no transaction runs.
    fn resync(
        &self,
        primary: &RwLock<Option<Database>>,
        primary_path: &Path,
    ) -> Result<(), String> {
        let _quiet = write(primary);
        let mut guard = write(&self.db);
        drop(guard.take());
        copy_file(primary_path, &self.path)
            .map_err(|e| format!("copying {}: {e}", primary_path.display()))?;
        let db = open_checked(&self.path).map_err(|e| format!("{}: {e}", self.path.display()))?;
        *guard = Some(db);
        Ok(())
    }
}

/// The commit number of the database (0 before the first commit of this build).
fn commit_seq(db: &Database) -> Result<u64, StoreError> {
    let txn = db.begin_read().map_err(redb_err)?;
    match txn.open_table(META) {
        Ok(t) => Ok(t
            .get(KEY_COMMIT_SEQ)
            .map_err(redb_err)?
            .map_or(0, |v| v.value())),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(0),
        Err(e) => Err(redb_err(e)),
    }
}

#[cfg(feature = "rados")]
pub(crate) fn json_err_pub(e: serde_json::Error) -> StoreError {
    json_err(e)
}

fn redb_err(e: impl Into<redb::Error>) -> StoreError {
    StoreError::Metadata(MetadataError::Redb(e.into()))
}

fn json_err(e: serde_json::Error) -> StoreError {
    StoreError::Metadata(MetadataError::Encoding(e))
}

impl Meta {
    /// `meta.redb` at `path`, with a metadata reserve of `reserve_bytes` in its directory
    /// (0: none). The open runs inside the reserve: if it fails for want of space, the
    /// reserve is released and the open tried once more, so a node starts on a full disk.
    /// `meta.redb` at `path`, with a metadata reserve of `reserve_bytes` in its directory
    /// (0: none) and, with `copy`, its second copy at that path. Every open runs redb's
    /// integrity check (`meta_file.rs`): a damaged file is `MetadataError::Damaged`, never a
    /// panic. The open runs inside the reserve: if it fails for want of space, the reserve
    /// is released and the open tried once more, so a node starts on a full disk. The copy
    /// is brought up to date from an intact primary (missing, damaged, or behind after a
    /// crash between the two writes); a primary that is missing, empty or behind its copy
    /// is refused (`headroom check --repair` restores it from the copy).
    pub(crate) fn open_file(
        path: &Path,
        reserve_bytes: u64,
        copy: Option<&Path>,
    ) -> Result<Meta, StoreError> {
        let dir = path.parent().unwrap_or(Path::new("."));
        if let Some(copy) = copy
            && file_len(path) == 0
            && file_len(copy) > 0
        {
            // redb would make an empty file a new, empty database.
            return Err(open_failure_err(
                path,
                OpenFailure::Damaged(format!(
                    "missing or empty while its copy {} holds metadata",
                    copy.display()
                )),
            ));
        }
        let reserve = Reserve::open(dir, reserve_bytes);
        let primary: PathBuf = path.to_path_buf();
        let opener: Opener =
            Box::new(move || open_checked(&primary).map_err(|f| open_failure_err(&primary, f)));
        let mut meta = Meta::open_with(opener, Some(reserve))?;
        let Some(copy_path) = copy else {
            return Ok(meta);
        };
        let c = Copy {
            path: copy_path.to_path_buf(),
            db: RwLock::new(None),
            stale: Mutex::new(None),
        };
        let primary_seq = meta.with_db(commit_seq)?;
        let resync_why = match open_checked(copy_path) {
            Ok(db) => {
                let copy_seq = commit_seq(&db)?;
                *write(&c.db) = Some(db);
                if copy_seq > primary_seq {
                    return Err(open_failure_err(
                        path,
                        OpenFailure::Damaged(format!(
                            "it is at commit {primary_seq}, behind its copy {} at commit \
                             {copy_seq}: it lost commits",
                            copy_path.display()
                        )),
                    ));
                }
                (copy_seq < primary_seq)
                    .then(|| format!("it is at commit {copy_seq}, the primary at {primary_seq}"))
            }
            Err(OpenFailure::Damaged(d)) => Some(format!("it is damaged ({d})")),
            Err(OpenFailure::Busy) => return Err(open_failure_err(copy_path, OpenFailure::Busy)),
            // A full disk or an I/O error on the copy does not stop the start: the primary
            // is intact. The copy is stale until a commit rewrites it.
            Err(e) => Some(format!("it cannot be opened ({e})")),
        };
        if let Some(why) = resync_why {
            tracing::warn!(copy = %copy_path.display(), "rewriting the metadata copy from meta.redb: {why}");
            if let Err(e) = c.resync(&meta.db, path) {
                tracing::error!(copy = %copy_path.display(), error = %e, "metadata copy not rewritten; it is rewritten at the next commit");
                *lock(&c.stale) = Some(e);
            }
        }
        meta.copy = Some((c, path.to_path_buf()));
        Ok(meta)
    }

    /// The database that `opener` opens (and opens again after an I/O error), with an
    /// optional reserve: the entry for redb on another `redb::StorageBackend`.
    pub(crate) fn open_with(opener: Opener, reserve: Option<Reserve>) -> Result<Meta, StoreError> {
        let db = match opener() {
            Err(e) if is_enospc(&e) && reserve.as_ref().is_some_and(Reserve::release) => opener(),
            other => other,
        }?;
        Ok(Meta {
            db: RwLock::new(Some(db)),
            opener: Some(opener),
            reserve,
            copy: None,
            last_error: Mutex::new(None),
            commits: CommitWatch::default(),
            #[cfg(feature = "rados")]
            rados: None,
        })
    }

    /// Metadata kept in the omap of the object `meta` of the pool's namespace.
    #[cfg(feature = "rados")]
    pub(crate) fn open_rados(pool: std::sync::Arc<crate::rados::Pool>) -> Result<Meta, StoreError> {
        let mut m = Meta::open_memory()?;
        m.rados = Some(crate::rados_meta::RadosMeta::new(pool));
        Ok(m)
    }

    pub(crate) fn open_memory() -> Result<Meta, StoreError> {
        let db = redb::Builder::new()
            .set_cache_size(CACHE_SIZE_BYTES)
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .map_err(redb_err)?;
        Ok(Meta {
            db: RwLock::new(Some(db)),
            opener: None,
            reserve: None,
            copy: None,
            last_error: Mutex::new(None),
            commits: CommitWatch::default(),
            #[cfg(feature = "rados")]
            rados: None,
        })
    }

    /// Metadata in redb on a disk of a simulated pool (`sim_disk.rs`, the power-cut test):
    /// the same database code as `meta.redb`, on storage that loses unsynced writes. No
    /// reopen after an I/O error (an error there only follows the simulated power cut), no
    /// reserve and no copy.
    pub(crate) fn open_simulated(
        disk: std::sync::Arc<crate::sim_disk::SimDisk>,
    ) -> Result<Meta, StoreError> {
        let db = redb::Builder::new()
            .set_cache_size(CACHE_SIZE_BYTES)
            .create_with_backend(crate::sim_disk::SimBackend(disk))
            .map_err(redb_err)?;
        Ok(Meta {
            db: RwLock::new(Some(db)),
            opener: None,
            reserve: None,
            copy: None,
            last_error: Mutex::new(None),
            commits: CommitWatch::default(),
            #[cfg(feature = "rados")]
            rados: None,
        })
    }

    /// Runs `f` on the open database.
    fn with_db<T>(
        &self,
        f: impl FnOnce(&Database) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let guard = read(&self.db);
        match guard.as_ref() {
            Some(db) => f(db),
            None => Err(MetadataError::Closed(
                "the metadata database could not be opened again after an I/O error".into(),
            )
            .into()),
        }
    }

    /// Drops the database and opens it again (releasing the reserve and trying once more if
    /// the open itself finds the disk full).
    fn reopen(&self) -> Result<(), StoreError> {
        let Some(opener) = &self.opener else {
            return Ok(());
        };
        let mut guard = write(&self.db);
        // The old handle must be closed first: it holds the file's lock.
        drop(guard.take());
        let db = match opener() {
            Err(e) if is_enospc(&e) && self.reserve.as_ref().is_some_and(Reserve::release) => {
                opener()
            }
            other => other,
        }
        .map_err(|e| MetadataError::Closed(format!("reopening the metadata database: {e}")))?;
        *guard = Some(db);
        tracing::warn!("metadata database reopened after an I/O error");
        Ok(())
    }

    /// Runs the write `f`; on an I/O error (or a poisoned handle) releases the reserve if
    /// the disk is full, reopens the database and runs `f` once more. Records the outcome
    /// for `health`.
    fn write_txn<T>(
        &self,
        f: impl Fn(&Database) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let result = match self.with_db(&f) {
            Err(e) if needs_reopen(&e) && self.opener.is_some() => {
                tracing::error!(error = %e, "metadata write failed; reopening the database");
                if is_enospc(&e)
                    && let Some(r) = &self.reserve
                {
                    r.release();
                }
                self.reopen().and_then(|()| self.with_db(&f))
            }
            other => other,
        };
        self.record(result.as_ref().err());
        result
    }

    /// Remembers the outcome of a write; after a success, takes the reserve again if it was
    /// released and there is room now.
    fn record(&self, error: Option<&StoreError>) {
        *lock(&self.last_error) = error.map(ToString::to_string);
        if error.is_none()
            && let Some(r) = &self.reserve
            && !r.is_held()
        {
            r.try_establish();
        }
    }

    /// Whether the metadata reserve was released (the disk filled) and not taken again: the
    /// space it freed is the metadata's, so no new data extent is allocated meanwhile.
    pub(crate) fn reserve_in_use(&self) -> bool {
        self.reserve.as_ref().is_some_and(|r| !r.is_held())
    }

    /// Why metadata commits may not work now; empty if they do. With `probe`, a failed last
    /// write or a released reserve is checked again first: an empty transaction is
    /// committed (reopening a poisoned handle) and the reserve taken if there is room. A
    /// commit in progress for `COMMIT_HUNG_AFTER_MS` or more is a reason, and then nothing
    /// is probed: the probe would wait behind it.
    pub(crate) fn health(&self, probe: bool) -> CommitHealth {
        self.health_at(probe, std::time::Instant::now())
    }

    /// [`Meta::health`] as of `now`.
    pub(crate) fn health_at(&self, probe: bool, now: std::time::Instant) -> CommitHealth {
        let hung = self.commits.hung_for(now);
        let unhealthy =
            lock(&self.last_error).is_some() || self.reserve.as_ref().is_some_and(|r| !r.is_held());
        if probe && unhealthy && hung.is_none() {
            let _ = self.probe();
        }
        let mut reasons = Vec::new();
        if let Some(running) = hung {
            reasons.push(hung_reason(running));
        }
        if let Some(e) = lock(&self.last_error).as_ref() {
            reasons.push(format!("metadata commits fail: {e}"));
        }
        if let Some(r) = &self.reserve
            && !r.is_held()
        {
            reasons.push(format!(
                "metadata reserve in use: the disk is full (the {}-byte reserve comes back once \
                 twice that is free)",
                r.size_bytes()
            ));
        }
        if let Some((c, _)) = &self.copy
            && let Some(e) = lock(&c.stale).as_ref()
        {
            reasons.push(format!(
                "metadata copy out of date: {e} (rewritten from meta.redb at the next commit)"
            ));
        }
        CommitHealth { reasons }
    }

    /// Registers a commit in progress until the guard drops (`commit_watch.rs`): the store's
    /// commit holds one over its device syncs and its transaction; this module's writes
    /// hold their own.
    pub(crate) fn commit_in_progress(&self) -> CommitInProgress<'_> {
        self.commits.start()
    }

    /// Registers a commit in progress that started at `at` (tests: one hung for a chosen
    /// time).
    pub(crate) fn commit_in_progress_since(&self, at: std::time::Instant) -> CommitInProgress<'_> {
        self.commits.start_at(at)
    }

    /// How long the oldest commit in progress has run, if `COMMIT_HUNG_AFTER_MS` or more.
    pub(crate) fn commit_hung_for(&self) -> Option<std::time::Duration> {
        self.commits.hung_for(std::time::Instant::now())
    }

    /// Commits an empty transaction (through the reopen and reserve logic of a write).
    pub(crate) fn probe(&self) -> Result<(), StoreError> {
        let _in_progress = self.commit_in_progress();
        #[cfg(feature = "rados")]
        if self.rados.is_some() {
            return Ok(());
        }
        self.write_txn(|db| {
            let txn = db.begin_write().map_err(redb_err)?;
            txn.commit().map_err(redb_err)
        })
    }

    /// Loads everything; `None` for a database that was never initialised.
    pub(crate) fn load(&self) -> Result<Option<Loaded>, StoreError> {
        #[cfg(feature = "rados")]
        if let Some(r) = &self.rados {
            return r.load();
        }
        self.with_db(load_db)
    }

    /// Applies `changes` in order, then `ops`, in one transaction committed with immediate
    /// durability. Nothing is applied if it fails.
    pub(crate) fn commit(
        &self,
        changes: &[ExtentChange],
        ops: &[MetaOp],
    ) -> Result<(), StoreError> {
        let _in_progress = self.commit_in_progress();
        #[cfg(feature = "rados")]
        if let Some(r) = &self.rados {
            return r.commit(changes, ops);
        }
        self.write_txn(|db| commit_db(db, changes, ops))?;
        if let Some((c, primary_path)) = &self.copy {
            let stale = lock(&c.stale).clone();
            let result = match stale {
                Some(_) => c.resync(&self.db, primary_path),
                None => {
                    let guard = read(&c.db);
                    match guard.as_ref() {
                        Some(db) => commit_db(db, changes, ops).map_err(|e| e.to_string()),
                        None => Err("the copy is not open".into()),
                    }
                }
            };
            if let Err(e) = &result {
                tracing::error!(copy = %c.path.display(), error = %e, "metadata copy not updated; it is rewritten at the next commit");
            }
            *lock(&c.stale) = result.err();
        }
        Ok(())
    }

    /// Upserts the state row of every listed volume that still exists, in one transaction
    /// committed with immediate durability; rows of unknown (deleted) volumes are skipped.
    /// Returns how many rows were written. The existence check runs inside the transaction,
    /// and redb serialises write transactions, so a save can never resurrect the row of a
    /// volume whose deletion committed first (and a row saved just before a deletion is
    /// removed by it).
    pub(crate) fn save_states(&self, states: &[(u64, Vec<u8>)]) -> Result<usize, StoreError> {
        if states.is_empty() {
            return Ok(0);
        }
        let _in_progress = self.commit_in_progress();
        #[cfg(feature = "rados")]
        if let Some(r) = &self.rados {
            return r.save_states(states);
        }
        self.write_txn(|db| save_states_db(db, states))
    }

    /// Every state row of an existing volume, by volume id. (Rows of unknown volumes exist
    /// only if an older build, which does not know the table, deleted the volume; volume ids
    /// are never reused, so they are skipped rather than reported.)
    pub(crate) fn load_states(&self) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        #[cfg(feature = "rados")]
        if let Some(r) = &self.rados {
            return r.load_states();
        }
        self.with_db(load_states_db)
    }
}

/// Everything stored in `db` and its commit number (`headroom check`).
pub(crate) fn load_loaded(db: &Database) -> Result<(Option<Loaded>, u64), StoreError> {
    Ok((load_db(db)?, commit_seq(db)?))
}

fn load_db(db: &Database) -> Result<Option<Loaded>, StoreError> {
    let txn = db.begin_read().map_err(redb_err)?;
    let meta = match txn.open_table(META) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(redb_err(e)),
    };
    let get = |k: &str| -> Result<Option<u64>, StoreError> {
        Ok(meta.get(k).map_err(redb_err)?.map(|v| v.value()))
    };
    let Some(format) = get(KEY_FORMAT)? else {
        return Ok(None);
    };
    if format != FORMAT_VERSION {
        return Err(MetadataError::Unsupported(format!(
            "format version {format}, this build reads {FORMAT_VERSION}"
        ))
        .into());
    }
    let extent_size = get(KEY_EXTENT_SIZE)?.unwrap_or(0);
    if extent_size != EXTENT_SIZE_BYTES {
        return Err(MetadataError::Unsupported(format!(
            "extent size {extent_size}, this build uses {EXTENT_SIZE_BYTES}"
        ))
        .into());
    }
    let mut loaded = Loaded {
        next_volume_id: get(KEY_NEXT_VOLUME_ID)?.unwrap_or(1),
        clean: get(KEY_CLEAN)? == Some(1),
        pool_id: get(KEY_POOL_ID)?,
        ..Loaded::default()
    };
    let devices = txn.open_table(DEVICES).map_err(redb_err)?;
    for row in devices.iter().map_err(redb_err)? {
        let (k, v) = row.map_err(redb_err)?;
        let rec: DeviceRecord = serde_json::from_str(v.value()).map_err(json_err)?;
        loaded.devices.push((k.value(), rec));
    }
    let volumes = txn.open_table(VOLUMES).map_err(redb_err)?;
    for row in volumes.iter().map_err(redb_err)? {
        let (k, v) = row.map_err(redb_err)?;
        let rec: VolumeRecord = serde_json::from_str(v.value()).map_err(json_err)?;
        loaded.volumes.push((k.value(), rec));
    }
    match txn.open_table(TENANTS) {
        Ok(tenants) => {
            for row in tenants.iter().map_err(redb_err)? {
                let (k, v) = row.map_err(redb_err)?;
                let rec: TenantRecord = serde_json::from_str(v.value()).map_err(json_err)?;
                loaded.tenants.push((k.value().to_string(), rec));
            }
        }
        Err(redb::TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(redb_err(e)),
    }
    let extents = txn.open_table(EXTENTS).map_err(redb_err)?;
    for row in extents.iter().map_err(redb_err)? {
        let (k, v) = row.map_err(redb_err)?;
        let (volume_id, extent) = k.value();
        loaded
            .extents
            .push((volume_id, extent, PhysExtent::from_db(v.value())));
    }
    match txn.open_table(REPLICA_EXTENTS) {
        Ok(rows) => {
            for row in rows.iter().map_err(redb_err)? {
                let (k, v) = row.map_err(redb_err)?;
                let (volume_id, replica, extent) = k.value();
                let replica = u8::try_from(replica).map_err(|_| {
                    MetadataError::Corrupt(format!(
                        "volume {volume_id} has a row of replica {replica}"
                    ))
                })?;
                loaded.replica_extents.push((
                    volume_id,
                    replica,
                    extent,
                    PhysExtent::from_db(v.value()),
                ));
            }
        }
        Err(redb::TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(redb_err(e)),
    }
    Ok(Some(loaded))
}

fn commit_db(db: &Database, changes: &[ExtentChange], ops: &[MetaOp]) -> Result<(), StoreError> {
    let txn = db.begin_write().map_err(redb_err)?;
    {
        let mut meta = txn.open_table(META).map_err(redb_err)?;
        let mut devices = txn.open_table(DEVICES).map_err(redb_err)?;
        let mut volumes = txn.open_table(VOLUMES).map_err(redb_err)?;
        let mut extents = txn.open_table(EXTENTS).map_err(redb_err)?;
        let mut credits = txn.open_table(CREDITS).map_err(redb_err)?;
        let mut tenants = txn.open_table(TENANTS).map_err(redb_err)?;
        let mut replica_extents = txn.open_table(REPLICA_EXTENTS).map_err(redb_err)?;
        // Numbers the commit in this file; the copy gets the same number (`Copy`).
        let seq = meta
            .get(KEY_COMMIT_SEQ)
            .map_err(redb_err)?
            .map_or(0, |v| v.value());
        meta.insert(KEY_COMMIT_SEQ, seq + 1).map_err(redb_err)?;
        for c in changes {
            match *c {
                ExtentChange::Map {
                    volume_id,
                    replica: 0,
                    extent,
                    phys,
                } => {
                    extents
                        .insert((volume_id, extent), phys.to_db())
                        .map_err(redb_err)?;
                }
                ExtentChange::Map {
                    volume_id,
                    replica,
                    extent,
                    phys,
                } => {
                    replica_extents
                        .insert((volume_id, u64::from(replica), extent), phys.to_db())
                        .map_err(redb_err)?;
                }
                ExtentChange::Unmap {
                    volume_id,
                    replica: 0,
                    extent,
                } => {
                    extents.remove((volume_id, extent)).map_err(redb_err)?;
                }
                ExtentChange::Unmap {
                    volume_id,
                    replica,
                    extent,
                } => {
                    replica_extents
                        .remove((volume_id, u64::from(replica), extent))
                        .map_err(redb_err)?;
                }
            }
        }
        for op in ops {
            match op {
                MetaOp::Init => {
                    meta.insert(KEY_FORMAT, FORMAT_VERSION).map_err(redb_err)?;
                    meta.insert(KEY_EXTENT_SIZE, EXTENT_SIZE_BYTES)
                        .map_err(redb_err)?;
                    meta.insert(KEY_NEXT_VOLUME_ID, 1).map_err(redb_err)?;
                }
                MetaOp::PutDevice(id, rec) => {
                    let json = serde_json::to_string(rec).map_err(json_err)?;
                    devices.insert(*id, json.as_str()).map_err(redb_err)?;
                }
                MetaOp::PutVolume(id, rec) => {
                    let json = serde_json::to_string(rec).map_err(json_err)?;
                    volumes.insert(*id, json.as_str()).map_err(redb_err)?;
                }
                MetaOp::DeleteVolume(id) => {
                    volumes.remove(*id).map_err(redb_err)?;
                    credits.remove(*id).map_err(redb_err)?;
                    extents
                        .retain_in((*id, 0u64)..=(*id, u64::MAX), |_, _| false)
                        .map_err(redb_err)?;
                    replica_extents
                        .retain_in((*id, 0u64, 0u64)..=(*id, u64::MAX, u64::MAX), |_, _| false)
                        .map_err(redb_err)?;
                }
                MetaOp::SetNextVolumeId(n) => {
                    meta.insert(KEY_NEXT_VOLUME_ID, *n).map_err(redb_err)?;
                }
                MetaOp::SetClean(clean) => {
                    meta.insert(KEY_CLEAN, u64::from(*clean))
                        .map_err(redb_err)?;
                }
                MetaOp::SetPoolId(id) => {
                    meta.insert(KEY_POOL_ID, *id).map_err(redb_err)?;
                }
                MetaOp::PutTenant(id, rec) => {
                    let json = serde_json::to_string(rec).map_err(json_err)?;
                    tenants
                        .insert(id.as_str(), json.as_str())
                        .map_err(redb_err)?;
                }
                MetaOp::DeleteTenant(id) => {
                    tenants.remove(id.as_str()).map_err(redb_err)?;
                }
                MetaOp::FailDevice(id) | MetaOp::RestoreDevice(id) => {
                    let json = devices
                        .get(*id)
                        .map_err(redb_err)?
                        .map(|v| v.value().to_string())
                        .ok_or_else(|| {
                            MetadataError::Corrupt(format!("no record of device {id}"))
                        })?;
                    let mut rec: DeviceRecord = serde_json::from_str(&json).map_err(json_err)?;
                    rec.failed = matches!(op, MetaOp::FailDevice(_));
                    let json = serde_json::to_string(&rec).map_err(json_err)?;
                    devices.insert(*id, json.as_str()).map_err(redb_err)?;
                }
            }
        }
    }
    txn.commit().map_err(redb_err)
}

fn save_states_db(db: &Database, states: &[(u64, Vec<u8>)]) -> Result<usize, StoreError> {
    let mut txn = db.begin_write().map_err(redb_err)?;
    txn.set_durability(Durability::Immediate)
        .map_err(redb_err)?;
    let mut saved = 0;
    {
        let volumes = txn.open_table(VOLUMES).map_err(redb_err)?;
        let mut credits = txn.open_table(CREDITS).map_err(redb_err)?;
        for (id, bytes) in states {
            if volumes.get(*id).map_err(redb_err)?.is_none() {
                continue;
            }
            credits.insert(*id, bytes.as_slice()).map_err(redb_err)?;
            saved += 1;
        }
    }
    txn.commit().map_err(redb_err)?;
    Ok(saved)
}

fn load_states_db(db: &Database) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
    let txn = db.begin_read().map_err(redb_err)?;
    let credits = match txn.open_table(CREDITS) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(redb_err(e)),
    };
    let volumes = txn.open_table(VOLUMES).map_err(redb_err)?;
    let mut out = Vec::new();
    for row in credits.iter().map_err(redb_err)? {
        let (k, v) = row.map_err(redb_err)?;
        let id = k.value();
        if volumes.get(id).map_err(redb_err)?.is_some() {
            out.push((id, v.value().to_vec()));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_in_memory() {
        let m = Meta::open_memory().unwrap();
        assert!(m.load().unwrap().is_none());
        let dev = DeviceRecord {
            path: "devices/dev-0.img".into(),
            relative: true,
            capacity_bytes: 8 * EXTENT_SIZE_BYTES,
            failure_domain: None,
            failed: false,
            reserved_extents: 0,
        };
        let vol = VolumeRecord {
            name: "v".into(),
            size_bytes: 4096,
            created_unix_s: 7,
            qos: Some(r#"{"iops":100}"#.into()),
            tenant: Some("alice".into()),
            read_only: true,
            replicas: 1,
            attachments: None,
        };
        let p = PhysExtent {
            device: 0,
            index: 5,
        };
        m.commit(
            &[
                ExtentChange::Map {
                    volume_id: 3,
                    replica: 0,
                    extent: 0,
                    phys: p,
                },
                ExtentChange::Map {
                    volume_id: 3,
                    replica: 0,
                    extent: 1,
                    phys: PhysExtent {
                        device: 0,
                        index: 6,
                    },
                },
                ExtentChange::Unmap {
                    volume_id: 3,
                    replica: 0,
                    extent: 1,
                },
            ],
            &[
                MetaOp::Init,
                MetaOp::PutDevice(0, dev.clone()),
                MetaOp::PutVolume(3, vol.clone()),
                MetaOp::SetNextVolumeId(4),
                MetaOp::SetClean(true),
            ],
        )
        .unwrap();
        let l = m.load().unwrap().unwrap();
        assert_eq!(l.next_volume_id, 4);
        assert!(l.clean);
        assert_eq!(l.devices, vec![(0, dev)]);
        assert_eq!(l.volumes, vec![(3, vol)]);
        assert_eq!(l.extents, vec![(3, 0, p)]);
        assert_eq!(m.save_states(&[(3, vec![1, 2]), (9, vec![3])]).unwrap(), 1);
        assert_eq!(m.load_states().unwrap(), vec![(3, vec![1, 2])]);
        m.commit(&[], &[MetaOp::DeleteVolume(3)]).unwrap();
        let l = m.load().unwrap().unwrap();
        assert!(l.volumes.is_empty() && l.extents.is_empty());
        assert!(m.load_states().unwrap().is_empty());
    }

    #[test]
    fn volume_record_without_qos_loads_as_none_and_is_written_unchanged() {
        let old_json = r#"{"name":"v","size_bytes":4096,"created_unix_s":7}"#;
        let m = Meta::open_memory().unwrap();
        {
            // A database written by a build before the `qos` field and the `credits` table.
            let guard = m.db.read().unwrap();
            let txn = guard.as_ref().unwrap().begin_write().unwrap();
            {
                let mut meta = txn.open_table(META).unwrap();
                meta.insert(KEY_FORMAT, FORMAT_VERSION).unwrap();
                meta.insert(KEY_EXTENT_SIZE, EXTENT_SIZE_BYTES).unwrap();
                txn.open_table(DEVICES).unwrap();
                txn.open_table(EXTENTS).unwrap();
                txn.open_table(VOLUMES)
                    .unwrap()
                    .insert(3, old_json)
                    .unwrap();
            }
            txn.commit().unwrap();
        }
        assert!(m.load_states().unwrap().is_empty());
        let l = m.load().unwrap().unwrap();
        let rec = VolumeRecord {
            name: "v".into(),
            size_bytes: 4096,
            created_unix_s: 7,
            qos: None,
            tenant: None,
            read_only: false,
            replicas: 1,
            attachments: None,
        };
        assert_eq!(l.volumes, vec![(3, rec.clone())]);
        assert_eq!(serde_json::to_string(&rec).unwrap(), old_json);
    }

    #[test]
    fn volume_record_tenant_and_read_only_round_trip_and_old_records_have_neither() {
        // A record of the build that added QoS, before tenants: no tenant, writable.
        let qos_only = r#"{"name":"v","size_bytes":4096,"created_unix_s":7,"qos":"{}"}"#;
        let rec: VolumeRecord = serde_json::from_str(qos_only).unwrap();
        assert_eq!(rec.tenant, None);
        assert!(!rec.read_only);
        assert_eq!(serde_json::to_string(&rec).unwrap(), qos_only);
        // With both fields, through redb and back.
        let rec = VolumeRecord {
            tenant: Some("Tenant A".into()),
            read_only: true,
            ..rec
        };
        let json = serde_json::to_string(&rec).unwrap();
        assert!(
            json.contains(r#""tenant":"Tenant A""#) && json.contains(r#""read_only":true"#),
            "{json}"
        );
        let m = Meta::open_memory().unwrap();
        m.commit(&[], &[MetaOp::Init, MetaOp::PutVolume(5, rec.clone())])
            .unwrap();
        assert_eq!(m.load().unwrap().unwrap().volumes, vec![(5, rec)]);
    }

    /// A file backend whose writes, syncs and length changes fail with `errno` while it is set.
    #[derive(Debug)]
    struct FailingBackend {
        inner: redb::backends::FileBackend,
        errno: std::sync::Arc<std::sync::atomic::AtomicI32>,
    }

    impl FailingBackend {
        fn check(&self) -> std::io::Result<()> {
            match self.errno.load(std::sync::atomic::Ordering::SeqCst) {
                0 => Ok(()),
                e => Err(std::io::Error::from_raw_os_error(e)),
            }
        }
    }

    impl redb::StorageBackend for FailingBackend {
        fn len(&self) -> std::io::Result<u64> {
            self.inner.len()
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            self.inner.read(offset, out)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.check()?;
            self.inner.set_len(len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            self.check()?;
            self.inner.sync_data()
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.check()?;
            self.inner.write(offset, data)
        }
        fn close(&self) -> std::io::Result<()> {
            self.inner.close()
        }
    }

    /// redb on `FailingBackend` over the file at `path`, failing with `errno` when set.
    fn open_failing(
        path: &Path,
        errno: &std::sync::Arc<std::sync::atomic::AtomicI32>,
    ) -> Result<Database, StoreError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        redb::Builder::new()
            .create_with_backend(FailingBackend {
                inner: redb::backends::FileBackend::new(file).map_err(redb_err)?,
                errno: errno.clone(),
            })
            .map_err(redb_err)
    }

    /// A `Meta` on `FailingBackend` over `dir/meta.redb`, and its error switch.
    fn failing_meta(
        dir: &Path,
        reserve: Option<Reserve>,
    ) -> (Meta, std::sync::Arc<std::sync::atomic::AtomicI32>) {
        let errno = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
        let path = dir.join("meta.redb");
        let e = errno.clone();
        let opener: Opener = Box::new(move || open_failing(&path, &e));
        (Meta::open_with(opener, reserve).unwrap(), errno)
    }

    /// Holds the next sync of a `StallingBackend` once armed: says so on `entered`, then
    /// waits for `release` (a disk that stops answering, on cue, and answers again).
    #[derive(Debug, Default)]
    struct Stall {
        armed: Mutex<Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>>,
    }

    impl Stall {
        /// Arms the stall: the first receiver hears that a sync is held, the sender lets it go.
        fn arm(&self) -> (std::sync::mpsc::Receiver<()>, std::sync::mpsc::Sender<()>) {
            let (entered_tx, entered) = std::sync::mpsc::channel();
            let (release, release_rx) = std::sync::mpsc::channel();
            *lock(&self.armed) = Some((entered_tx, release_rx));
            (entered, release)
        }
    }

    /// `FailingBackend` whose next sync, once its `Stall` is armed, hangs until released.
    #[derive(Debug)]
    struct StallingBackend {
        inner: FailingBackend,
        stall: std::sync::Arc<Stall>,
    }

    impl redb::StorageBackend for StallingBackend {
        fn len(&self) -> std::io::Result<u64> {
            self.inner.len()
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            self.inner.read(offset, out)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.inner.set_len(len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            let armed = lock(&self.stall.armed).take();
            if let Some((entered, release)) = armed {
                let _ = entered.send(());
                let _ = release.recv();
            }
            self.inner.sync_data()
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.inner.write(offset, data)
        }
        fn close(&self) -> std::io::Result<()> {
            self.inner.close()
        }
    }

    /// A `Meta` on `StallingBackend` over `dir/meta.redb`: its error switch and its stall.
    fn stalling_meta(
        dir: &Path,
    ) -> (
        Meta,
        std::sync::Arc<std::sync::atomic::AtomicI32>,
        std::sync::Arc<Stall>,
    ) {
        let errno = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
        let stall = std::sync::Arc::new(Stall::default());
        let path = dir.join("meta.redb");
        let (e, s) = (errno.clone(), stall.clone());
        let opener: Opener = Box::new(move || {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)?;
            redb::Builder::new()
                .create_with_backend(StallingBackend {
                    inner: FailingBackend {
                        inner: redb::backends::FileBackend::new(file).map_err(redb_err)?,
                        errno: e.clone(),
                    },
                    stall: s.clone(),
                })
                .map_err(redb_err)
        });
        (Meta::open_with(opener, None).unwrap(), errno, stall)
    }

    /// A commit whose sync hangs is a reason from `COMMIT_HUNG_AFTER_MS` on (asked as of a
    /// later instant: no waiting), the health with `probe` answers without a probe commit
    /// (which would wait behind the hung one) although the last write failed, and once the
    /// disk answers the commit goes through and the reason is gone.
    #[test]
    fn a_hung_commit_is_a_reason_and_no_probe_queues_behind_it() {
        use crate::commit_watch::COMMIT_HUNG_AFTER_MS;
        let bound = std::time::Duration::from_millis(COMMIT_HUNG_AFTER_MS);
        let patience = std::time::Duration::from_secs(10);
        let dir = tempfile::tempdir().unwrap();
        let (m, errno, stall) = stalling_meta(dir.path());
        let m = std::sync::Arc::new(m);
        m.commit(&[map(1, 0)], &[MetaOp::Init]).unwrap();
        // A failed write first, so that the health with `probe` would probe.
        errno.store(
            rustix::io::Errno::IO.raw_os_error(),
            std::sync::atomic::Ordering::SeqCst,
        );
        m.commit(&[map(1, 1)], &[]).unwrap_err();
        errno.store(0, std::sync::atomic::Ordering::SeqCst);

        let (entered, release) = stall.arm();
        let committing = std::sync::Arc::clone(&m);
        let commit = std::thread::spawn(move || committing.commit(&[map(1, 2)], &[]));
        entered
            .recv_timeout(patience)
            .expect("the commit reached its sync");
        let is_hung = |h: &CommitHealth| {
            h.reasons
                .iter()
                .any(|r| r.starts_with("a metadata commit has not finished for "))
        };
        // Just started: not hung (the failed write is the one reason).
        let now = std::time::Instant::now();
        let h = m.health_at(false, now);
        assert!(!is_hung(&h) && h.reasons.len() == 1, "{h:?}");
        // A bound later: hung, and the failed write is still named.
        let h = m.health_at(false, now + bound);
        assert!(is_hung(&h) && h.reasons.len() == 2, "{h:?}");
        // With `probe`: answered at once, without a probe commit behind the hung one.
        let (answer_tx, answer) = std::sync::mpsc::channel();
        let asking = std::sync::Arc::clone(&m);
        std::thread::spawn(move || {
            let _ = answer_tx.send(asking.health_at(true, now + bound));
        });
        let probed = answer.recv_timeout(patience);
        let _ = release.send(());
        let h = probed.expect("the health waited behind the hung commit (it probed)");
        assert!(is_hung(&h), "{h:?}");

        commit.join().unwrap().unwrap();
        let h = m.health_at(false, std::time::Instant::now() + bound);
        assert!(h.is_ready(), "{h:?}");
    }

    fn map(volume_id: u64, extent: u64) -> ExtentChange {
        ExtentChange::Map {
            volume_id,
            replica: 0,
            extent,
            phys: PhysExtent {
                device: 0,
                index: extent as u32,
            },
        }
    }

    /// An I/O error poisons redb's handle (`PreviousIo` on every later call); the next commit
    /// reopens the database and goes through, without a restart, and health says so.
    #[test]
    fn poisoned_handle_is_reopened_and_the_commit_retried() {
        let dir = tempfile::tempdir().unwrap();
        let (m, errno) = failing_meta(dir.path(), None);
        m.commit(&[map(1, 0)], &[MetaOp::Init]).unwrap();
        assert!(m.health(false).is_ready());
        // Fails now: the first attempt and the retry on a reopened handle.
        errno.store(
            rustix::io::Errno::IO.raw_os_error(),
            std::sync::atomic::Ordering::SeqCst,
        );
        let e = m.commit(&[map(1, 1)], &[]).unwrap_err();
        assert!(needs_reopen(&e), "{e}");
        let h = m.health(false);
        assert!(
            h.reasons.len() == 1 && h.reasons[0].starts_with("metadata commits fail: "),
            "{h:?}"
        );
        // The device recovers: the very next commit works (redb alone would answer
        // PreviousIo until a restart) and nothing committed before is lost.
        errno.store(0, std::sync::atomic::Ordering::SeqCst);
        m.commit(&[map(1, 2)], &[]).unwrap();
        assert!(m.health(false).is_ready());
        let l = m.load().unwrap().unwrap();
        let extents: Vec<u64> = l.extents.iter().map(|r| r.1).collect();
        assert_eq!(extents, vec![0, 2]);
        // A probe alone (no commit) also brings health back after a failure.
        errno.store(
            rustix::io::Errno::IO.raw_os_error(),
            std::sync::atomic::Ordering::SeqCst,
        );
        assert!(m.save_states(&[(1, vec![1])]).is_err());
        assert!(!m.health(true).is_ready());
        errno.store(0, std::sync::atomic::Ordering::SeqCst);
        assert!(m.health(true).is_ready());
    }

    /// The handle is poisoned by one failed write: the failure is a one-off (a transient
    /// EIO), and the retry inside the same commit on the reopened handle succeeds.
    #[test]
    fn a_one_off_io_error_is_retried_within_the_commit() {
        let dir = tempfile::tempdir().unwrap();
        let errno = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
        let path = dir.path().join("meta.redb");
        let e = errno.clone();
        let opens = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let o = opens.clone();
        let opener: Opener = Box::new(move || {
            // Every open clears the error: the fault lasted one attempt.
            o.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            e.store(0, std::sync::atomic::Ordering::SeqCst);
            open_failing(&path, &e)
        });
        let m = Meta::open_with(opener, None).unwrap();
        m.commit(&[], &[MetaOp::Init]).unwrap();
        errno.store(
            rustix::io::Errno::IO.raw_os_error(),
            std::sync::atomic::Ordering::SeqCst,
        );
        m.commit(&[map(1, 0)], &[]).unwrap();
        assert_eq!(
            opens.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "reopened once"
        );
        assert_eq!(m.load().unwrap().unwrap().extents.len(), 1);
        assert!(m.health(false).is_ready());
    }

    /// ENOSPC: the reserve is released, the commit goes through on the reopened handle, and
    /// health names the reserve until it is taken again.
    #[test]
    fn enospc_releases_the_reserve_and_the_commit_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let reserve = Reserve::open(dir.path(), 1 << 20);
        assert!(reserve.is_held());
        let errno = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
        let path = dir.path().join("meta.redb");
        let e = errno.clone();
        let reserve_path = dir.path().join(crate::meta_reserve::RESERVE_FILE);
        let opener: Opener = Box::new(move || {
            // The disk is full while the reserve holds its blocks.
            let held = std::fs::metadata(&reserve_path).map_or(0, |m| {
                use std::os::unix::fs::MetadataExt;
                m.blocks()
            }) > 0;
            e.store(
                if held {
                    rustix::io::Errno::NOSPC.raw_os_error()
                } else {
                    0
                },
                std::sync::atomic::Ordering::SeqCst,
            );
            open_failing(&path, &e)
        });
        let m = Meta::open_with(opener, Some(reserve)).unwrap();
        // The open itself hit the full disk (a fresh file is written at creation), released
        // the reserve and went on.
        let h = m.health(false);
        assert!(
            h.reasons.len() == 1 && h.reasons[0].starts_with("metadata reserve in use"),
            "{h:?}"
        );
        m.commit(&[map(1, 0)], &[MetaOp::Init]).unwrap();
        assert_eq!(m.load().unwrap().unwrap().extents.len(), 1);
        // This disk has room: the successful commit took the reserve again.
        assert!(m.health(false).is_ready());
        assert!(m.reserve.as_ref().unwrap().is_held());
    }

    /// A write to the copy that fails leaves the commit done (the primary has it), marks the
    /// copy stale in the health, and the next commit rewrites the copy from the primary.
    #[test]
    fn a_failed_copy_write_is_reported_and_repaired_by_the_next_commit() {
        let dir = tempfile::tempdir().unwrap();
        let primary = dir.path().join("meta.redb");
        let copy = dir.path().join("meta-copy.redb");
        let m = Meta::open_file(&primary, 0, Some(&copy)).unwrap();
        m.commit(&[map(1, 0)], &[MetaOp::Init]).unwrap();
        assert!(m.health(false).is_ready());
        // The copy's handle is gone (as after a failed reopen of its disk).
        drop(write(&m.copy.as_ref().unwrap().0.db).take());
        m.commit(&[map(1, 1)], &[]).unwrap();
        let h = m.health(false);
        assert!(
            h.reasons.len() == 1 && h.reasons[0].starts_with("metadata copy out of date"),
            "{h:?}"
        );
        m.commit(&[map(1, 2)], &[]).unwrap();
        assert!(m.health(false).is_ready(), "{:?}", m.health(false));
        drop(m);
        // The copy holds every commit, the one it missed included.
        let db = open_checked(&copy).unwrap();
        let (loaded, seq) = load_loaded(&db).unwrap();
        assert_eq!(seq, 3);
        assert_eq!(loaded.unwrap().extents.len(), 3);
    }
}
