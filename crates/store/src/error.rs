//! Errors of the store layer.
//!
//! Why: the NBD server maps each variant to the errno the protocol names (NoSpace -> ENOSPC,
//! OutOfRange -> EINVAL/ENOSPC, Io and Metadata -> EIO) and the management API maps the
//! volume-level ones to HTTP statuses, so the variants describe what went wrong, not where.

/// Every failure of a store or volume operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The pool has no free extent left for a new allocation.
    #[error("no free space left in the storage pool")]
    NoSpace,
    /// The request reaches past the end of the volume (or overflows 64 bits).
    #[error(
        "range at offset {offset} with length {length} is outside the volume of {size_bytes} bytes"
    )]
    OutOfRange {
        offset: u64,
        length: u64,
        size_bytes: u64,
    },
    /// No volume has this name.
    #[error("volume {0:?} not found")]
    NotFound(String),
    /// A volume with this name exists already.
    #[error("volume {0:?} already exists")]
    AlreadyExists(String),
    /// A device cannot be added to the pool as asked (path, size, backend or count).
    #[error("cannot add device {path}: {reason}")]
    InvalidDevice { path: String, reason: String },
    /// The pool has no device with this id.
    #[error("the pool has no device {0}")]
    DeviceNotFound(u32),
    /// The path is already a device of the pool.
    #[error("{0} is already device of the pool")]
    DeviceExists(String),
    /// The name breaks the naming rule (1-64 chars of `[A-Za-z0-9._-]`, not starting with `.` or `-`).
    #[error("invalid volume name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    /// The tenant id breaks the tenant rule (1-128 printable ASCII characters, no surrounding
    /// spaces).
    #[error("invalid tenant id {tenant:?}: {reason}")]
    InvalidTenant {
        tenant: String,
        reason: &'static str,
    },
    /// A volume size is zero, too large, or not a multiple of 512 bytes.
    #[error("invalid volume size {size_bytes}: {reason}")]
    InvalidSize {
        size_bytes: u64,
        reason: &'static str,
    },
    /// A volume cannot have this many replicas here (more than `MAX_REPLICAS`, more than the
    /// pool's healthy devices, or more than 1 on a RADOS store).
    #[error("cannot create a volume with {replicas} replicas: {reason}")]
    InvalidReplicas { replicas: u8, reason: String },
    /// No tenant has this id (`create_tenant` first).
    #[error("tenant {0:?} not found")]
    TenantNotFound(String),
    /// A tenant with this id exists already.
    #[error("tenant {0:?} already exists")]
    TenantExists(String),
    /// A tenant cannot be deleted while volumes belong to it.
    #[error("tenant {tenant:?} still has {volumes} volume(s): delete them first")]
    TenantHasVolumes { tenant: String, volumes: usize },
    /// Creating or growing a volume would provision more than the overcommit ratio allows
    /// (`Store::set_overcommit_ratio`).
    #[error(
        "overcommitted: this would provision {} ({after_bytes} bytes) in all, more than the \
         limit of {} ({limit_bytes} bytes) = overcommit_ratio {ratio} x pool capacity {} \
         ({capacity_bytes} bytes); {} are provisioned now",
        gib(*after_bytes), gib(*limit_bytes), gib(*capacity_bytes), gib(*provisioned_bytes)
    )]
    Overcommitted {
        /// Sum of the volume sizes now.
        provisioned_bytes: u64,
        /// Sum of the volume sizes if the change were made.
        after_bytes: u64,
        /// `ratio` times the pool capacity.
        limit_bytes: u64,
        capacity_bytes: u64,
        ratio: f64,
    },
    /// A volume names a tenant that was never created.
    #[error("tenant {0:?} does not exist")]
    UnknownTenant(String),
    /// The store configuration cannot be used (device count, capacity, paths).
    #[error("invalid store configuration: {0}")]
    InvalidConfig(String),
    /// The volume behind this handle was deleted.
    #[error("volume {0:?} was deleted")]
    VolumeDeleted(String),
    /// A block of a volume's data failed checksum verification and no copy that verifies was
    /// found (a 1-replica volume, or every copy damaged): the request fails (EIO) instead of
    /// returning data that is not what was written.
    #[error(
        "checksum mismatch in volume {volume:?} at byte {offset}: device {device} returned data \
         that is not what was written (no good copy to repair it from)"
    )]
    Checksum {
        volume: String,
        /// Byte offset in the volume of the bad 4 KiB block.
        offset: u64,
        device: u32,
    },
    /// A device read, write, punch or sync failed.
    #[error("device I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The metadata database failed or holds something this build cannot use.
    #[error("metadata error: {0}")]
    Metadata(#[from] MetadataError),
}

/// Bytes as GiB with two decimals, for messages.
fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Failures of the metadata database.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    /// redb reported an error (I/O, corruption, or the database is open in another process).
    #[error("redb: {0}")]
    Redb(#[from] redb::Error),
    /// A record could not be encoded or decoded.
    #[error("record encoding: {0}")]
    Encoding(#[from] serde_json::Error),
    /// The records contradict each other (e.g. one physical extent mapped twice).
    #[error("metadata is inconsistent: {0}")]
    Corrupt(String),
    /// The metadata database is not open: opening it again after an I/O error failed (the
    /// next write tries again).
    #[error("metadata database closed: {0}")]
    Closed(String),
    /// A metadata file is damaged (redb's integrity check failed, it is cut short, redb
    /// panicked reading it, or it is missing beside its copy).
    #[error(
        "{path} is damaged: {detail}. Stop the server and run `headroom check --data-dir \
         {data_dir} --repair`: it restores the file from its copy (meta-copy.redb)"
    )]
    Damaged {
        path: String,
        data_dir: String,
        detail: String,
    },
    /// The database was written by a build with another format or extent size.
    #[error("unsupported metadata format: {0}")]
    Unsupported(String),
}

impl From<redb::Error> for StoreError {
    fn from(e: redb::Error) -> Self {
        StoreError::Metadata(MetadataError::Redb(e))
    }
}
