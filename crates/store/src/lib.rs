//! headroom-store: volumes on a pool of local devices, with durable metadata.
//!
//! Why this crate exists: every byte an NBD client writes lands here. It turns a volume
//! (a thin-provisioned, resizable virtual disk) into fixed-size extents placed on a pool of
//! backing devices (sparse files, block devices, RAM, or objects of a Ceph RADOS pool with the
//! `rados` feature), and keeps the extent maps in an
//! embedded transactional database (redb; in RADOS, the omap of one object written atomically
//! per commit, `rados_meta.rs`) so that what a client was told is durable stays
//! durable across a crash (docs/design.md principle 5).
//!
//! The data path (`Volume::read_at` / `write_at`) takes no global lock: it resolves the extent
//! through an in-memory map of atomics under a per-volume read lock and does positional I/O on
//! the device. Only extent allocation and release take the pool mutex, and only FLUSH, FUA and
//! management operations touch redb. See `README.md` in this crate for the durability protocol.

mod alloc;
pub mod arbiter;
pub mod check;
mod checksum;
#[cfg(feature = "rados")]
mod cls_lock_assert;
#[cfg_attr(not(feature = "rados"), allow(dead_code))]
mod cls_lock_info;
mod commit_watch;
mod config;
mod device;
mod device_admission;
mod devices;
mod error;
mod extent_map;
mod fault;
mod layout;
#[cfg(feature = "rados")]
mod lease;
#[cfg(feature = "rados")]
mod lease_clock;
mod lease_loss;
mod meta;
mod meta_file;
mod meta_reserve;
#[doc(hidden)]
pub mod mutants;
mod name;
#[cfg(feature = "rados")]
mod rados;
#[cfg(feature = "rados")]
mod rados_inflight;
#[cfg(feature = "rados")]
mod rados_meta;
mod signature;
#[doc(hidden)]
pub mod sim_disk;
mod stats;
mod store;
pub mod sync;
mod telemetry;
mod volume;

pub use commit_watch::{COMMIT_HUNG_AFTER_MS, CommitInProgress};
pub use config::{
    DEFAULT_DEVICE_CAPACITY_BYTES, DEFAULT_DEVICE_COUNT, DEFAULT_LEASE_MS, DEFAULT_RADOS_ID,
    MAX_DEVICES, MAX_RADOS_ID_LEN, RADOS_SUPPORTED, RadosTarget, StoreConfig, validate_rados_id,
};
pub use device_admission::{
    AdmissionPolicy, BLOCK_EDGE_BYTES, BLOCK_SAMPLE_BYTES, BLOCK_SAMPLES, DEFAULT_MAX_DEVICE_BYTES,
    InvalidPolicy,
};
pub use error::{MetadataError, StoreError};
pub use fault::{FaultConfig, FaultConfigError, FaultRule, FaultScope, MAX_LATENCY_SPIKE_MS};
pub use layout::{EXTENT_SIZE_BYTES, MAX_REPLICAS, MAX_VOLUME_SIZE_BYTES, VOLUME_SIZE_ALIGN_BYTES};
pub use lease_loss::{DEFAULT_LEASE_LOST_LINGER_MS, LEASE_LOST_EXIT_STATUS, LeaseLoss};
pub use meta::CommitHealth;
pub use meta_reserve::{DEFAULT_METADATA_RESERVE_BYTES, RESERVE_FILE};
pub use name::{MAX_TENANT_ID_LEN, MAX_VOLUME_NAME_LEN, validate_tenant_id, validate_volume_name};
pub use stats::{
    DeviceOp, DeviceOpStats, DeviceStats, LATENCY_FINITE_BUCKETS, LatencyHistogram,
    LatencySnapshot, latency_bucket,
};
pub use store::{DeviceInfo, DeviceRestore, NewVolume, PoolInfo, Store, TenantInfo};
pub use telemetry::{DeviceTelemetry, EWMA_ALPHA};
pub use volume::{
    AioDone, AioRequest, Extent, PhysicalLocation, RebuildStep, ScrubReport, Volume, VolumeHealth,
    VolumeInfo,
};
