//! One rule per node-owned setting, in the crate that owns the value.
//!
//! Why: `headroom serve` checked these ranges itself, so a `NodeConfig` built by `calibrate`,
//! the lab or a test went unchecked, and each range was written twice. Now each rule is a
//! function here (or beside its part: `scheduler::config`), `NodeConfig::validate` runs them
//! all at `Node::start`, and the binary calls the same functions to report a file's value
//! in the file's words before anything starts.

/// A setting out of its range: the key as the configuration file writes it, the value, and
/// what is allowed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{key} = {value}: {allowed}")]
pub struct InvalidSetting {
    pub key: &'static str,
    /// The value as the file would write it (a string quoted).
    pub value: String,
    pub allowed: String,
}

impl InvalidSetting {
    pub(crate) fn new(
        key: &'static str,
        value: impl std::fmt::Display,
        allowed: impl Into<String>,
    ) -> InvalidSetting {
        InvalidSetting {
            key,
            value: value.to_string(),
            allowed: allowed.into(),
        }
    }
}

/// Longest coalescing wait accepted: beyond it the wait is latency, not batching.
pub const MAX_COALESCE_US: u64 = 1000;

/// Most I/O executor threads per lane a configuration may ask for.
pub const MAX_IO_THREADS: usize = 256;

/// `server.io_threads`: 0 (inline) to [`MAX_IO_THREADS`].
pub fn check_io_threads(n: usize) -> Result<(), InvalidSetting> {
    if n > MAX_IO_THREADS {
        return Err(InvalidSetting::new(
            "server.io_threads",
            count(n),
            format!("must be between 0 (inline) and {MAX_IO_THREADS}"),
        ));
    }
    Ok(())
}

/// `server.coalesce_us`: 0 (off) to [`MAX_COALESCE_US`].
pub fn check_coalesce_us(us: u64) -> Result<(), InvalidSetting> {
    let max = MAX_COALESCE_US;
    if us > max {
        return Err(InvalidSetting::new(
            "server.coalesce_us",
            us,
            format!("must be between 0 (off) and {max}"),
        ));
    }
    Ok(())
}

/// `server.net_threads`: 0 (the shared runtime) to [`crate::net_threads::MAX_NET_THREADS`].
pub fn check_net_threads(n: usize) -> Result<(), InvalidSetting> {
    let max = crate::net_threads::MAX_NET_THREADS;
    if n > max {
        return Err(InvalidSetting::new(
            "server.net_threads",
            count(n),
            format!("must be between 0 (connections on the shared runtime) and {max}"),
        ));
    }
    Ok(())
}

/// Highest background rate accepted (the scrub's, like `PUT /v1/scrub`'s): 10 GiB/s.
pub const MAX_BACKGROUND_RATE_BYTES_PER_S: u64 = 10 << 30;
/// Longest scrub interval accepted: a year.
pub const MAX_SCRUB_INTERVAL_S: u64 = 365 * 24 * 3600;
/// Largest metadata reserve: far more than any pool's metadata needs.
pub const MAX_METADATA_RESERVE_BYTES: u64 = 64 << 30;

/// `storage.scrub.rate`: 1 byte to [`MAX_BACKGROUND_RATE_BYTES_PER_S`] per second.
pub fn check_scrub_rate_bytes_per_s(rate: u64) -> Result<(), InvalidSetting> {
    if !(1..=MAX_BACKGROUND_RATE_BYTES_PER_S).contains(&rate) {
        return Err(InvalidSetting::new(
            "storage.scrub.rate",
            rate,
            "1 byte to 10GiB per second",
        ));
    }
    Ok(())
}

/// `storage.scrub.interval_s`: 0 (only on demand) to [`MAX_SCRUB_INTERVAL_S`].
pub fn check_scrub_interval_s(interval_s: u64) -> Result<(), InvalidSetting> {
    if interval_s > MAX_SCRUB_INTERVAL_S {
        return Err(InvalidSetting::new(
            "storage.scrub.interval_s",
            interval_s,
            "0 (only on demand) to 31536000 (a year)",
        ));
    }
    Ok(())
}

/// `qos.credit_save_period_ms`: at least 1.
pub fn check_credit_save_period_ms(ms: u64) -> Result<(), InvalidSetting> {
    if ms == 0 {
        return Err(InvalidSetting::new(
            "qos.credit_save_period_ms",
            0,
            "must be at least 1",
        ));
    }
    Ok(())
}

/// `storage.metadata_reserve`: 0 (none) to [`MAX_METADATA_RESERVE_BYTES`].
pub fn check_metadata_reserve_bytes(bytes: u64) -> Result<(), InvalidSetting> {
    if bytes > MAX_METADATA_RESERVE_BYTES {
        return Err(InvalidSetting::new(
            "storage.metadata_reserve",
            bytes,
            "must be at most 64GiB (0: no reserve)",
        ));
    }
    Ok(())
}

/// Shortest and longest RADOS lease accepted, ms.
pub const RADOS_LEASE_MS: std::ops::RangeInclusive<u64> = 100..=3_600_000;
/// Longest linger after a lost lease accepted: 10 minutes.
pub const MAX_LEASE_LOST_LINGER_MS: u64 = 600_000;

/// `storage.memory`: a RAM pool of at least one byte.
pub fn check_memory_bytes(bytes: u64) -> Result<(), InvalidSetting> {
    if bytes == 0 {
        return Err(InvalidSetting::new(
            "storage.memory",
            0,
            "must be greater than 0",
        ));
    }
    Ok(())
}

/// `storage.devices`: at least one device file.
pub fn check_device_count(n: u32) -> Result<(), InvalidSetting> {
    if n == 0 {
        return Err(InvalidSetting::new(
            "storage.devices",
            0,
            "must be at least 1",
        ));
    }
    Ok(())
}

/// `storage.device_size`: at least one byte.
pub fn check_device_size(bytes: u64) -> Result<(), InvalidSetting> {
    if bytes == 0 {
        return Err(InvalidSetting::new(
            "storage.device_size",
            0,
            "must be greater than 0",
        ));
    }
    Ok(())
}

/// `storage.rados_pool`: a pool name, not empty, no `/` (nor NUL).
pub fn check_rados_pool(pool: &str) -> Result<(), InvalidSetting> {
    if pool.is_empty() || pool.contains(['/', '\0']) {
        return Err(InvalidSetting::new(
            "storage.rados_pool",
            format!("{pool:?}"),
            "must be a pool name: not empty, no '/'",
        ));
    }
    Ok(())
}

/// `storage.rados_namespace`: a namespace name, not empty, no `/` (nor NUL).
pub fn check_rados_namespace(ns: &str) -> Result<(), InvalidSetting> {
    if ns.is_empty() || ns.contains(['/', '\0']) {
        return Err(InvalidSetting::new(
            "storage.rados_namespace",
            format!("{ns:?}"),
            "must be a namespace name: not empty, no '/'",
        ));
    }
    Ok(())
}

/// `storage.rados_id`: a cephx user the store accepts (`headroom_store::validate_rados_id`).
pub fn check_rados_id(id: &str) -> Result<(), InvalidSetting> {
    headroom_store::validate_rados_id(id)
        .map_err(|why| InvalidSetting::new("storage.rados_id", format!("{id:?}"), why))
}

/// `storage.rados_lease_ms`: within [`RADOS_LEASE_MS`].
pub fn check_rados_lease_ms(ms: u64) -> Result<(), InvalidSetting> {
    if !RADOS_LEASE_MS.contains(&ms) {
        return Err(InvalidSetting::new(
            "storage.rados_lease_ms",
            ms,
            "must be between 100 and 3600000",
        ));
    }
    Ok(())
}

/// `storage.rados_lease_lost_linger_ms`: at most [`MAX_LEASE_LOST_LINGER_MS`].
pub fn check_rados_lease_lost_linger_ms(ms: u64) -> Result<(), InvalidSetting> {
    if ms > MAX_LEASE_LOST_LINGER_MS {
        return Err(InvalidSetting::new(
            "storage.rados_lease_lost_linger_ms",
            ms,
            "must be at most 600000 (10 minutes)",
        ));
    }
    Ok(())
}

pub(crate) fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}
