//! `[storage]` and its tables `[storage.scrub]` and `[storage.rebuild]`: where the data
//! lives (files, block devices, RAM or a RADOS pool), what `device add` may take, and the
//! background jobs over it. Each key is declared once here (file name, flag, help, check,
//! where it lands); `[storage.emulated]` has a file of its own.

use std::path::PathBuf;

use clap::Args;
use headroom_node::{NodeConfig, StoreBackend, setting};
use headroom_qos::routing::ReadRouting;
use merge::Merge;
use serde::Deserialize;

use super::emulated::EmulatedSection;
use super::{DEFAULT_DEVICE_SIZE, DEFAULT_DEVICES, Invalid, Size};
use crate::size::format_size;

/// `[storage]`: where the data lives, and an optional emulated device in front of it.
#[derive(Args, Clone, Debug, Default, PartialEq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct StorageSection {
    /// Directory for device files and metadata (created if missing) [default: ./headroom-data].
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Give new device files and block devices per-block checksums (absent: true).
    #[arg(skip)]
    pub checksums: Option<bool>,
    /// Refuse to create or grow a volume when the volume sizes would sum to more than this
    /// many times the pool capacity (a number >= 1.0) [default: no limit].
    #[arg(long, value_name = "RATIO")]
    pub overcommit_ratio: Option<f64>,
    /// Keep everything in RAM with this pool capacity (e.g. 4GiB) instead of the data directory.
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<Size>,
    /// Number of device files in a new data directory [default: 2].
    #[arg(long, value_name = "N")]
    pub devices: Option<u32>,
    /// Capacity of each device file in a new data directory (sparse), or with --rados-pool
    /// the address space extents are allocated from [default: 64GiB].
    #[arg(long, value_name = "SIZE")]
    pub device_size: Option<Size>,
    /// Use this existing block device or file as a pool device (repeatable; replaces the
    /// created device files).
    #[arg(long = "device", value_name = "PATH")]
    pub device_paths: Option<Vec<PathBuf>>,
    /// Directories whose regular files `device add` may use or create (absent:
    /// `DATA_DIR/devices/` only).
    #[arg(skip)]
    pub device_dirs: Option<Vec<PathBuf>>,
    /// Block devices `device add` may use (absent: none).
    #[arg(skip)]
    pub block_devices: Option<Vec<PathBuf>>,
    /// Largest device `device add` takes (absent: 64 TiB).
    #[arg(skip)]
    pub max_device_bytes: Option<Size>,
    /// Largest volume that may be created or grown to (absent and at most: 64 TiB).
    #[arg(skip)]
    pub max_volume_bytes: Option<Size>,
    /// Disk space held back in the data directory for metadata commits when the disk is
    /// full (`meta-reserve`; absent: 64 MiB; 0: none).
    #[arg(skip)]
    pub metadata_reserve: Option<Size>,
    /// Which copy of a replicated volume serves a read (`headroom_qos::routing`).
    #[arg(skip)]
    pub read_routing: Option<ReadRouting>,
    /// Keep the extents in a Ceph RADOS pool: the cluster's ceph.conf (with --rados-pool;
    /// needs a build with --features rados).
    #[arg(long, value_name = "FILE")]
    pub rados_conf: Option<PathBuf>,
    /// The RADOS pool (existing) holding the extents (with --rados-conf).
    #[arg(long, value_name = "POOL")]
    pub rados_pool: Option<String>,
    /// Connect to Ceph as this cephx user, without `client.` (its keyring named by the
    /// ceph.conf; e.g. headroom for client.headroom) [default: admin].
    #[arg(long, value_name = "ID")]
    pub rados_id: Option<String>,
    /// Open the existing RADOS store in this namespace (headroom-<16 hex>; e.g. another
    /// node's, to take it over) [default: the data directory's, or a new one].
    #[arg(long, value_name = "NS")]
    pub rados_namespace: Option<String>,
    /// The node's lease on a RADOS store lasts this long without renewal (renewed every
    /// third of it) [default: 30000].
    #[arg(long, value_name = "MS")]
    pub rados_lease_ms: Option<u64>,
    /// Wait at most this long at start for another node's lease to expire [default: no limit].
    #[arg(long, value_name = "MS")]
    pub rados_lease_wait_ms: Option<u64>,
    /// After losing the lease, keep answering /readyz (503, naming the loss) this long, then
    /// exit with status 3 [default: 5000].
    #[arg(long, value_name = "MS")]
    pub rados_lease_lost_linger_ms: Option<u64>,
    /// Share the RADOS pool's capacity with the other nodes on it: report demand every
    /// epoch, and pace this node at the share the arbiter gives it (with --rados-capacity-iops).
    #[arg(long, num_args = 0, default_missing_value = "true")]
    pub rados_arbitration: Option<bool>,
    /// The pool's capacity all nodes share, operations per second (with --rados-arbitration).
    #[arg(long, value_name = "IOPS")]
    pub rados_capacity_iops: Option<u64>,
    /// The pool's capacity all nodes share, bytes per second (e.g. 400MiB) [default: IOPS only].
    #[arg(long, value_name = "SIZE")]
    pub rados_capacity_bytes_per_s: Option<Size>,
    /// This node's id among the nodes on the pool [default: <hostname>-<NBD port>].
    #[arg(long, value_name = "ID")]
    pub rados_node_id: Option<String>,
    /// This node's weight in the split of what baselines leave [default: 1].
    #[arg(long, value_name = "N")]
    pub rados_weight: Option<u64>,
    /// How often nodes report and the arbiter splits, ms [default: 500].
    #[arg(long, value_name = "MS")]
    pub rados_arbitration_epoch_ms: Option<u64>,
    /// An emulated device in front of the store (taken whole from one layer).
    #[arg(skip)]
    pub emulated: Option<EmulatedSection>,
    /// Merged key by key when two layers have it.
    #[arg(skip)]
    #[merge(strategy = merge::option::recurse)]
    pub rebuild: Option<RebuildSection>,
    /// Merged key by key when two layers have it.
    #[arg(skip)]
    #[merge(strategy = merge::option::recurse)]
    pub scrub: Option<ScrubSection>,
}

/// `[storage.scrub]`: the background scrub that verifies every allocated block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct ScrubSection {
    /// Bytes per second the scrub reads at (`PUT /v1/scrub` changes it live).
    pub rate: Option<Size>,
    /// Seconds from the start of one pass to the start of the next (0: only on demand).
    pub interval_s: Option<u64>,
}

/// `[storage.rebuild]`: the rebuild of lost copies after a device failure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct RebuildSection {
    /// Bytes per second the rebuild starts at (`PUT /v1/rebuild` changes it live).
    pub rate: Option<Size>,
    /// Read and write errors after which a device is failed for good (0: never).
    pub fail_device_after_errors: Option<u64>,
}

impl StorageSection {
    /// Checks every value that can be checked on its own.
    pub(super) fn check(&self) -> Result<(), Invalid> {
        let st = self;
        if let Some(size) = st.memory {
            setting::check_memory_bytes(size.0)?;
        }
        if let (Some(size), Some(_)) = (st.metadata_reserve, st.memory) {
            return Err(Invalid::new(
                "storage.metadata_reserve",
                size,
                "a RAM store keeps no metadata on disk; leave it out with storage.memory",
            ));
        }
        if let Some(size) = st.metadata_reserve {
            setting::check_metadata_reserve_bytes(size.0).map_err(|err| Invalid {
                value: size.to_string(),
                ..err.into()
            })?;
        }
        if let Some(ratio) = st.overcommit_ratio
            && !(ratio.is_finite() && ratio >= 1.0)
        {
            return Err(Invalid::new(
                "storage.overcommit_ratio",
                ratio,
                "must be a number of at least 1.0 (1.0: no overcommit; leave it out for no limit)",
            ));
        }
        if let Some(n) = st.devices {
            setting::check_device_count(n)?;
        }
        if let Some(size) = st.device_size {
            setting::check_device_size(size.0)?;
        }
        // The store's rule, on this layer's values over the defaults (which pass it); sizes
        // shown as the file writes them.
        self.admission().validate().map_err(|err| {
            let size = match err.key {
                "storage.max_device_bytes" => st.max_device_bytes,
                "storage.max_volume_bytes" => st.max_volume_bytes,
                _ => None,
            };
            Invalid {
                key: err.key.to_string(),
                value: size.map_or(err.value, |s| s.to_string()),
                allowed: err.allowed,
            }
        })?;
        if let Some(pool) = &st.rados_pool {
            setting::check_rados_pool(pool)?;
        }
        if let Some(id) = &st.rados_id {
            setting::check_rados_id(id)?;
        }
        if let Some(ns) = &st.rados_namespace {
            setting::check_rados_namespace(ns)?;
        }
        if let Some(ms) = st.rados_lease_ms {
            setting::check_rados_lease_ms(ms)?;
        }
        if let Some(ms) = st.rados_lease_lost_linger_ms {
            setting::check_rados_lease_lost_linger_ms(ms)?;
        }
        for (key, set) in [
            ("storage.rados_id", st.rados_id.is_some()),
            (
                "storage.rados_lease_lost_linger_ms",
                st.rados_lease_lost_linger_ms.is_some(),
            ),
            ("storage.rados_namespace", st.rados_namespace.is_some()),
            ("storage.rados_lease_ms", st.rados_lease_ms.is_some()),
            (
                "storage.rados_lease_wait_ms",
                st.rados_lease_wait_ms.is_some(),
            ),
        ] {
            if set && st.rados_pool.is_none() {
                return Err(Invalid::new(
                    key,
                    "set",
                    "needs storage.rados_pool (--rados-pool)",
                ));
            }
        }
        if let Some(e) = &st.emulated {
            e.check()?;
        }
        if let Some(scrub) = st.scrub {
            scrub.check()?;
        }
        Ok(())
    }

    /// The store backend: RAM, a RADOS pool, or device files in the data directory.
    pub(super) fn backend(&self, data_dir: PathBuf) -> Result<StoreBackend, Invalid> {
        let st = self;
        let rados = rados_target(st)?;
        Ok(match (st.memory, rados) {
            (Some(size), _) => StoreBackend::Memory {
                capacity_bytes: size.0,
            },
            (None, Some((conf, pool))) => StoreBackend::Rados {
                data_dir,
                conf,
                id: st
                    .rados_id
                    .clone()
                    .unwrap_or_else(|| headroom_store::DEFAULT_RADOS_ID.to_owned()),
                pool,
                capacity_bytes: st.device_size.map_or(DEFAULT_DEVICE_SIZE, |s| s.0),
                namespace: st.rados_namespace.clone(),
                lease_ms: st
                    .rados_lease_ms
                    .unwrap_or(headroom_store::DEFAULT_LEASE_MS),
                lease_wait_ms: st.rados_lease_wait_ms,
                lease_lost_linger_ms: st
                    .rados_lease_lost_linger_ms
                    .unwrap_or(headroom_store::DEFAULT_LEASE_LOST_LINGER_MS),
            },
            (None, None) => StoreBackend::Files {
                data_dir,
                device_count: st.devices.unwrap_or(DEFAULT_DEVICES),
                device_capacity_bytes: st.device_size.map_or(DEFAULT_DEVICE_SIZE, |s| s.0),
                device_paths: st.device_paths.clone().unwrap_or_default(),
            },
        })
    }

    /// Sets what this layer has over the node's defaults (the backend aside).
    pub(super) fn apply(&self, config: &mut NodeConfig) {
        let st = self;
        if let Some(size) = st.metadata_reserve {
            config.metadata_reserve_bytes = size.0;
        }
        if let Some(checksums) = st.checksums {
            config.checksums = checksums;
        }
        config.emulated_device = st.emulated.as_ref().map(EmulatedSection::spec);
        config.emulated_curve = st.emulated.as_ref().and_then(EmulatedSection::curve);
        if let Some(routing) = st.read_routing {
            config.read_routing = routing;
        }
        config.overcommit_ratio = st.overcommit_ratio;
        config.device_admission = self.admission();
        if let Some(errors) = st.rebuild.and_then(|r| r.fail_device_after_errors) {
            config.fail_device_after_errors = errors;
        }
        if let Some(rate) = st.rebuild.and_then(|r| r.rate) {
            config.rebuild_rate_bytes_per_s = rate.0.max(1);
        }
        if let Some(scrub) = st.scrub {
            if let Some(rate) = scrub.rate {
                config.scrub_rate_bytes_per_s = rate.0;
            }
            if let Some(interval_s) = scrub.interval_s {
                config.scrub_interval_s = interval_s;
            }
        }
    }
}

impl StorageSection {
    /// What `device add` may take, this layer's values over the defaults.
    fn admission(&self) -> headroom_store::AdmissionPolicy {
        let d = headroom_store::AdmissionPolicy::default();
        headroom_store::AdmissionPolicy {
            device_dirs: self.device_dirs.clone().unwrap_or(d.device_dirs),
            block_devices: self.block_devices.clone().unwrap_or(d.block_devices),
            max_device_bytes: self.max_device_bytes.map_or(d.max_device_bytes, |s| s.0),
            max_volume_bytes: self.max_volume_bytes.map_or(d.max_volume_bytes, |s| s.0),
        }
    }
}

impl ScrubSection {
    /// The node's rules for the rate and the interval.
    fn check(&self) -> Result<(), Invalid> {
        if let Some(rate) = self.rate {
            setting::check_scrub_rate_bytes_per_s(rate.0).map_err(|err| Invalid {
                value: format_size(rate.0),
                ..err.into()
            })?;
        }
        if let Some(interval_s) = self.interval_s {
            setting::check_scrub_interval_s(interval_s)?;
        }
        Ok(())
    }
}

/// The RADOS cluster configuration and pool, when `storage.rados_*` is set: both keys
/// together, nothing that names local devices or RAM, and a build with the backend.
fn rados_target(st: &StorageSection) -> Result<Option<(PathBuf, String)>, Invalid> {
    let (conf, pool) = match (&st.rados_conf, &st.rados_pool) {
        (None, None) => return Ok(None),
        (Some(conf), Some(pool)) => (conf.clone(), pool.clone()),
        (Some(conf), None) => {
            return Err(Invalid::new(
                "storage.rados_conf",
                conf.display(),
                "needs storage.rados_pool (--rados-pool) too",
            ));
        }
        (None, Some(pool)) => {
            return Err(Invalid::new(
                "storage.rados_pool",
                pool,
                "needs storage.rados_conf (--rados-conf) too",
            ));
        }
    };
    if !headroom_store::RADOS_SUPPORTED {
        return Err(Invalid::new(
            "storage.rados_pool",
            &pool,
            "this headroom was built without the RADOS backend; rebuild with --features rados \
             (cargo build --release -p headroom --features rados; needs librados-dev)",
        ));
    }
    let conflict = if st.memory.is_some() {
        Some("storage.memory")
    } else if st.devices.is_some() {
        Some("storage.devices")
    } else if st.device_paths.is_some() {
        Some("storage.device_paths")
    } else {
        None
    };
    if let Some(key) = conflict {
        return Err(Invalid::new(
            "storage.rados_pool",
            &pool,
            format!("keeps the data in RADOS; leave out {key}"),
        ));
    }
    Ok(Some((conf, pool)))
}
