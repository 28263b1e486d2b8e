//! Store configuration: where the data lives and which devices make up the pool.
//!
//! Why: the server, the CLI and the tests all open a store; they share one struct with
//! defaults that work on a laptop (two sparse 64 GiB files that use no space until written).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Default number of device files created under `DATA_DIR/devices/`.
pub const DEFAULT_DEVICE_COUNT: u32 = 2;
/// Default (sparse) capacity of each created device file: 64 GiB.
pub const DEFAULT_DEVICE_CAPACITY_BYTES: u64 = 64 << 30;
/// Most devices one pool may hold (touched-device sets are 64-bit masks).
pub const MAX_DEVICES: u32 = 64;

/// How to open a store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreConfig {
    /// Directory holding `meta.redb` and, unless `device_paths` is set, `devices/dev-<n>.img`.
    pub data_dir: PathBuf,
    /// Number of device files to create under `data_dir/devices/` when `device_paths` is empty.
    #[serde(default = "default_device_count")]
    pub device_count: u32,
    /// Capacity of each device file this store creates (sparse; rounded down to whole extents).
    #[serde(default = "default_device_capacity_bytes")]
    pub device_capacity_bytes: u64,
    /// Explicit devices: existing block devices, existing files (their size is the capacity),
    /// or paths of files to create with `device_capacity_bytes`. Empty: use `device_count`.
    #[serde(default)]
    pub device_paths: Vec<PathBuf>,
    /// Keep the extents as objects of a RADOS pool instead of device files (one pool device
    /// of `device_capacity_bytes`; needs the `rados` feature). The metadata is then in RADOS
    /// too, and `data_dir` keeps only local state (the namespace's name, the API token).
    #[serde(default)]
    pub rados: Option<RadosTarget>,
    /// Bytes preallocated in `data_dir/meta-reserve` for metadata commits, released when
    /// the disk is full (`meta_reserve.rs`); 0: no reserve. Not used by RADOS stores.
    #[serde(default = "default_metadata_reserve_bytes")]
    pub metadata_reserve_bytes: u64,
    /// Keep a second durable copy of the metadata in `data_dir/meta-copy.redb`, written after
    /// `meta.redb` by every commit (`meta.rs`, `Copy`); `false` only to measure what it costs.
    #[serde(default = "default_metadata_copy")]
    pub metadata_copy: bool,
    /// Give the device files this open creates per-block checksums (`checksum.rs`); the
    /// node's `[storage] checksums`. `false` where the layer below checksums already, or to
    /// measure what checksums cost (`tests/checksum_cost.rs`); such devices are signed
    /// without them and stay so.
    #[serde(skip, default = "default_checksums")]
    pub checksums: bool,
}

fn default_checksums() -> bool {
    true
}

fn default_metadata_copy() -> bool {
    true
}

fn default_metadata_reserve_bytes() -> u64 {
    crate::meta_reserve::DEFAULT_METADATA_RESERVE_BYTES
}

/// A Ceph cluster and pool holding a store's extents (`StoreConfig::rados`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RadosTarget {
    /// The cluster's `ceph.conf` (monitor addresses, authentication: the keyring of the
    /// user `id`).
    pub conf: PathBuf,
    /// The cephx user the node connects as, without `client.` (`validate_rados_id`); the
    /// default `admin` is kept for compatibility, a dedicated user with the caps of
    /// docs/operations.md ("The cephx user") is what production uses.
    #[serde(default = "default_rados_id")]
    pub id: String,
    /// An existing pool.
    pub pool: String,
    /// The RADOS namespace of an existing store to open (`headroom-<16 hex>`); `None`: the
    /// one recorded in `data_dir/rados-namespace`, or a new one for a new store.
    #[serde(default)]
    pub namespace: Option<String>,
    /// How long the node's lease on the store lasts without a renewal (renewed every third
    /// of it); another node takes the store over this long after this one died.
    #[serde(default = "default_lease_ms")]
    pub lease_ms: u64,
    /// How long to wait at start for another node's lease to expire; `None`: as long as it
    /// takes.
    #[serde(default)]
    pub lease_wait_ms: Option<u64>,
}

/// Default `RadosTarget::id`: `client.admin`, what every node connected as before the
/// user could be chosen.
pub const DEFAULT_RADOS_ID: &str = "admin";

/// Most bytes of a cephx user id (`RadosTarget::id`).
pub const MAX_RADOS_ID_LEN: usize = 64;

fn default_rados_id() -> String {
    DEFAULT_RADOS_ID.to_owned()
}

/// Checks a cephx user id as `--rados-id` takes it: not empty, at most `MAX_RADOS_ID_LEN`
/// bytes of ASCII letters, digits, `_`, `-` and `.`, and without the `client.` prefix (the
/// id of `client.headroom` is `headroom`). The message says what is wrong.
pub fn validate_rados_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("must not be empty (the cephx user without `client.`, e.g. headroom)".into());
    }
    if id.len() > MAX_RADOS_ID_LEN {
        return Err(format!("must be at most {MAX_RADOS_ID_LEN} bytes"));
    }
    if let Some(rest) = id.strip_prefix("client.") {
        return Err(format!(
            "is the id without the `client.` prefix: {rest:?} for client.{rest}"
        ));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return Err("may hold only ASCII letters, digits, '_', '-' and '.'".into());
    }
    Ok(())
}

/// Default `RadosTarget::lease_ms`: 30 s.
pub const DEFAULT_LEASE_MS: u64 = 30_000;

fn default_lease_ms() -> u64 {
    DEFAULT_LEASE_MS
}

impl RadosTarget {
    /// `conf` and `pool` as `client.admin`, with the default lease and the namespace recorded in the data
    /// directory.
    pub fn new(conf: impl Into<PathBuf>, pool: impl Into<String>) -> RadosTarget {
        RadosTarget {
            conf: conf.into(),
            id: default_rados_id(),
            pool: pool.into(),
            namespace: None,
            lease_ms: DEFAULT_LEASE_MS,
            lease_wait_ms: None,
        }
    }
}

/// Whether this build has the RADOS backend (cargo feature `rados`).
pub const RADOS_SUPPORTED: bool = cfg!(feature = "rados");

fn default_device_count() -> u32 {
    DEFAULT_DEVICE_COUNT
}

fn default_device_capacity_bytes() -> u64 {
    DEFAULT_DEVICE_CAPACITY_BYTES
}

impl StoreConfig {
    /// Defaults: two sparse 64 GiB device files under `data_dir/devices/`.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        StoreConfig {
            data_dir: data_dir.into(),
            device_count: DEFAULT_DEVICE_COUNT,
            device_capacity_bytes: DEFAULT_DEVICE_CAPACITY_BYTES,
            device_paths: Vec::new(),
            checksums: true,
            rados: None,
            metadata_reserve_bytes: default_metadata_reserve_bytes(),
            metadata_copy: true,
        }
    }

    /// Path of the file naming the RADOS namespace of a RADOS store (local state).
    pub fn rados_namespace_path(&self) -> PathBuf {
        self.data_dir.join("rados-namespace")
    }

    /// Path of the metadata database.
    pub fn meta_path(&self) -> PathBuf {
        self.data_dir.join("meta.redb")
    }

    /// Path of the second copy of the metadata database.
    pub fn meta_copy_path(&self) -> PathBuf {
        self.data_dir.join("meta-copy.redb")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rados_ids_are_checked() {
        for ok in [
            "admin",
            "headroom",
            "node-1.a_b",
            &"x".repeat(MAX_RADOS_ID_LEN),
        ] {
            assert_eq!(validate_rados_id(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("", "must not be empty"),
            ("client.headroom", "\"headroom\" for client.headroom"),
            ("a b", "only ASCII"),
            ("a/b", "only ASCII"),
            ("é", "only ASCII"),
            ("a\0", "only ASCII"),
            (&"x".repeat(MAX_RADOS_ID_LEN + 1), "at most 64"),
        ] {
            let e = validate_rados_id(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }
}
